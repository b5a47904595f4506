"""Damaged checkpoints through the real server, in every layout: refused naming the file and the problem.

Five kinds of damage, each written by ``bad_files`` from the tiny real checkpoints, in the Comfy-Org
single files (bf16, ``fp8_e4m3fn``, ``fp8_scaled``), diffusers folders (shards + index) and LoRA files:
NaN/Inf values, missing or incomplete blocks, an index reaching outside its folder, integer or boolean
tensors, and a config.json that disagrees with the weights. After each refusal the next ordinary edit
runs and gives exactly the image it gave before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import bad_files as bad
import pytest
import torch
from fixtures_models import DIFFUSERS_FOLDER
from prompts import DIT, TEXT_ENCODER, TEXT_ENCODER_FP8, VAE, edit_prompt, fuse_lora, loader, write_image
from server_checks import assert_server_still_works, failing_node

LOAD, FUSE, SAMPLER = "QwenEditHopper_Load", "QwenEditHopper_FuseLoRA", "QwenEditHopper_Sampler"
VARIANT = "qwen-image-edit-2509"  # chosen by hand: the damaged files' names say nothing about the release
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def picture(comfy) -> str:
    return write_image(comfy.input_dir / "bad_checkpoints.png", 64, 64, seed=11)


@pytest.fixture(scope="module")
def baseline(comfy, picture):
    return assert_server_still_works(comfy, picture)


@dataclass
class Case:
    """One damaged input: what the prompt loads, the node that must refuse it, and what its message says."""

    node: str
    expected: list[str]
    load: dict = field(default_factory=dict)
    lora: str | None = None


def _models(comfy) -> Path:
    return comfy.models_dir


def _single(comfy, folder: str, source: str, name: str, edit: Callable) -> str:
    bad.edited(_models(comfy) / folder / source, _models(comfy) / folder / name, edit)
    return name


def _fp8_dit(comfy, form: str, name: str, edit: Callable) -> str:
    """The DiT in Comfy-Org's fp8 form ``form`` (``e4m3fn`` / ``scaled``), then ``edit``."""
    target = _models(comfy) / "diffusion_models" / name
    writer = bad.fp8_e4m3fn if form == "e4m3fn" else bad.fp8_scaled
    writer(_models(comfy) / "diffusion_models" / DIT, target)
    bad.edited(target, target, edit)
    return name


def _folder(comfy, name: str) -> Path:
    return bad.copy_folder(_models(comfy) / "qwen_edit" / DIFFUSERS_FOLDER, _models(comfy) / "qwen_edit" / name)


def _dit(name: str) -> dict:
    return {"dit": name, "variant": VARIANT}


# ----------------------------------------------------------------------------- 1. NaN / Inf values


def nan_in_bf16_dit(comfy) -> Case:
    key = "transformer_blocks.1.attn.to_k.weight"
    name = _single(comfy, "diffusion_models", DIT, "nan_dit_bf16.safetensors", lambda t: bad.poison(t, key))
    return Case(SAMPLER, [name, "NaN or Inf", repr(key), "download it again"], load=_dit(name))


def nan_in_fp8_e4m3fn_dit(comfy) -> Case:
    key = "transformer_blocks.0.img_mlp.net.2.weight"
    name = _fp8_dit(comfy, "e4m3fn", "nan_dit_fp8_e4m3fn.safetensors", lambda t: bad.poison(t, key))
    return Case(SAMPLER, [name, "NaN or Inf", repr(key)], load=_dit(name))


def inf_scale_in_fp8_scaled_dit(comfy) -> Case:
    key = "transformer_blocks.1.txt_mlp.net.0.proj.scale_weight"
    name = _fp8_dit(comfy, "scaled", "inf_dit_fp8_scaled.safetensors", lambda t: bad.poison(t, key, INF))
    return Case(SAMPLER, [name, "NaN or Inf", repr(key)], load=_dit(name))


def inf_in_bf16_text_encoder(comfy) -> Case:
    key = "model.layers.1.self_attn.v_proj.weight"
    name = _single(comfy, "text_encoders", TEXT_ENCODER, "inf_te_bf16.safetensors", lambda t: bad.poison(t, key, -INF))
    return Case(SAMPLER, [name, "NaN or Inf", repr(key)], load={"text_encoder": name})


def nan_in_fp8_scaled_text_encoder(comfy) -> Case:
    key = "model.layers.0.mlp.down_proj.weight"
    name = _single(comfy, "text_encoders", TEXT_ENCODER_FP8, "nan_te_fp8_scaled.safetensors",
                   lambda t: bad.poison(t, key))
    return Case(SAMPLER, [name, "NaN or Inf", repr(key)], load={"text_encoder": name})


def nan_in_comfy_vae(comfy) -> Case:
    key = "decoder.head.2.weight"
    name = _single(comfy, "vae", VAE, "nan_vae.safetensors", lambda t: bad.poison(t, key))
    return Case(SAMPLER, [name, "NaN or Inf", repr(key)], load={"vae": name})


def nan_in_diffusers_dit_shard(comfy) -> Case:
    folder = _folder(comfy, "Bad-NaN-Transformer-Shard")
    key = "transformer_blocks.1.img_mlp.net.0.proj.weight"
    shard = bad.shard_of(folder, "transformer", key)
    bad.edited(shard, shard, lambda t: bad.poison(t, key))
    return Case(SAMPLER, [shard.name, "NaN or Inf", repr(key)], load={"folder": folder.name})


def inf_in_diffusers_text_encoder_shard(comfy) -> Case:
    folder = _folder(comfy, "Bad-Inf-TextEncoder-Shard")
    key = "model.layers.1.mlp.gate_proj.weight"
    shard = bad.shard_of(folder, "text_encoder", key)
    bad.edited(shard, shard, lambda t: bad.poison(t, key, INF))
    return Case(SAMPLER, [shard.name, "NaN or Inf", repr(key)], load={"folder": folder.name})


def nan_in_diffusers_vae(comfy) -> Case:
    folder = _folder(comfy, "Bad-NaN-VAE")
    vae = folder / "vae" / "diffusion_pytorch_model.safetensors"
    key = "decoder.conv_out.weight"
    bad.edited(vae, vae, lambda t: bad.poison(t, key))
    return Case(SAMPLER, [vae.name, "NaN or Inf", repr(key)], load={"folder": folder.name})


def nan_in_lora(comfy) -> Case:
    key = "transformer_blocks.1.attn.to_q.lora_B.weight"
    name = _single(comfy, "loras", "tiny_peft.safetensors", "nan_lora.safetensors", lambda t: bad.poison(t, key))
    return Case(FUSE, [name, "NaN or Inf", f"'{key}'", "download it again"], lora=name)


# ----------------------------------------------------------------------------- 2. missing blocks


def first_block_missing(comfy) -> Case:
    name = _single(comfy, "diffusion_models", DIT, "gap_dit.safetensors",
                   lambda t: bad.drop(t, "transformer_blocks.0."))
    return Case(LOAD, [name, "lacks transformer blocks 0", "with gaps"], load=_dit(name))


def last_block_incomplete(comfy) -> Case:
    name = _single(comfy, "diffusion_models", DIT, "incomplete_dit.safetensors",
                   lambda t: bad.drop(t, "transformer_blocks.1.img_mlp."))
    return Case(LOAD, [name, "transformer block 1 lacks 4 of its", "'img_mlp.net.0.proj.weight'"], load=_dit(name))


def last_block_incomplete_fp8_e4m3fn(comfy) -> Case:
    name = _fp8_dit(comfy, "e4m3fn", "incomplete_dit_fp8.safetensors",
                    lambda t: bad.drop(t, "transformer_blocks.1.attn.to_out."))
    return Case(LOAD, [name, "transformer block 1 lacks 2 of its", "'attn.to_out.0.weight'"], load=_dit(name))


def text_encoder_layer_incomplete_fp8_scaled(comfy) -> Case:
    name = _single(comfy, "text_encoders", TEXT_ENCODER_FP8, "incomplete_te_fp8_scaled.safetensors",
                   lambda t: bad.drop(t, "model.layers.1.self_attn.o_proj."))
    return Case(LOAD, [name, "language-model layer 1 lacks 1 of its", "'self_attn.o_proj.weight'"],
                load={"text_encoder": name})


def released_width_dit_with_one_block(comfy) -> Case:
    path = bad.sparse_released_dit(_models(comfy) / "diffusion_models" / "released_width_1_block.safetensors", 1)
    return Case(LOAD, [path.name, "holds 1 transformer blocks", "the released Qwen-Image DiT at dim 3072 says 60"],
                load=_dit(path.name))


def diffusers_folder_without_its_last_block(comfy) -> Case:
    folder = _folder(comfy, "Bad-Last-Block-Missing")
    bad.edit_shards(folder, "transformer", lambda t: bad.drop(t, "transformer_blocks.1."))
    return Case(LOAD, ["transformer disagrees with transformer/config.json",
                       "num_layers is 2 there but 1 in the weights", folder.name], load={"folder": folder.name})


# ----------------------------------------------------------------------------- 3. index outside its folder


def _outside(comfy, how: str, part: str = "transformer") -> Case:
    folder = _folder(comfy, f"Bad-Index-{part}-{how}")
    entry, moved = bad.point_outside(folder, part, how, comfy.base_dir / f"outside_{part}_{how}")
    index = bad.index_path(folder, part).name
    wording = {"relative": "climbs out of its folder", "absolute": "an absolute path outside its folder",
               "link": f"which is a link to {moved.resolve()}"}[how]
    return Case(LOAD, [index, repr(entry), wording, "only name files inside itself"], load={"folder": folder.name})


def index_climbing_out(comfy) -> Case:
    return _outside(comfy, "relative")


def index_with_absolute_path(comfy) -> Case:
    return _outside(comfy, "absolute")


def index_entry_linking_out(comfy) -> Case:
    return _outside(comfy, "link")


def text_encoder_index_with_absolute_path(comfy) -> Case:
    return _outside(comfy, "absolute", part="text_encoder")


# ----------------------------------------------------------------------------- 4. integer / boolean tensors


def int_tensor_in_bf16_dit(comfy) -> Case:
    key = "transformer_blocks.0.attn.to_v.weight"
    name = _single(comfy, "diffusion_models", DIT, "int_dit.safetensors", lambda t: bad.as_dtype(t, key, torch.int32))
    return Case(LOAD, [name, "integer or boolean tensors where floating-point weights belong", f"{key!r} is I32"],
                load=_dit(name))


def bool_tensor_in_fp8_scaled_text_encoder(comfy) -> Case:
    key = "model.layers.0.input_layernorm.weight"
    name = _single(comfy, "text_encoders", TEXT_ENCODER_FP8, "bool_te_fp8_scaled.safetensors",
                   lambda t: bad.as_dtype(t, key, torch.bool))
    return Case(LOAD, [name, f"{key!r} is BOOL"], load={"text_encoder": name})


def int_tensor_in_comfy_vae(comfy) -> Case:
    key = "decoder.head.2.bias"
    name = _single(comfy, "vae", VAE, "int_vae.safetensors", lambda t: bad.as_dtype(t, key, torch.int64))
    return Case(LOAD, [name, f"{key!r} is I64"], load={"vae": name})


def int_tensor_in_diffusers_dit_shard(comfy) -> Case:
    folder = _folder(comfy, "Bad-Int-Transformer-Shard")
    key = "transformer_blocks.1.attn.norm_q.weight"
    shard = bad.shard_of(folder, "transformer", key)
    bad.edited(shard, shard, lambda t: bad.as_dtype(t, key, torch.int16))
    return Case(LOAD, [shard.name, f"{key!r} is I16"], load={"folder": folder.name})


def int_factor_in_lora(comfy) -> Case:
    key = "transformer_blocks.0.attn.to_q.lora_A.weight"
    name = _single(comfy, "loras", "tiny_peft.safetensors", "int_lora.safetensors",
                   lambda t: bad.as_dtype(t, key, torch.int32))
    return Case(FUSE, [name, f"'{key}'", "torch.int32", "floating point"], lora=name)


# ----------------------------------------------------------------------------- 5. config.json against the weights


def _config_case(comfy, part: str, field_name: str, value, expected: str) -> Case:
    folder = _folder(comfy, f"Bad-Config-{part}-{field_name}")
    bad.edit_json(folder / part / "config.json", **{field_name: value})
    return Case(LOAD, [f"disagrees with {part}/config.json", expected, folder.name], load={"folder": folder.name})


def transformer_config_says_60_layers(comfy) -> Case:
    return _config_case(comfy, "transformer", "num_layers", 60, "num_layers is 60 there but 2 in the weights")


def text_encoder_config_says_28_layers(comfy) -> Case:
    return _config_case(comfy, "text_encoder", "num_hidden_layers", 28,
                        "num_hidden_layers is 28 there but 2 in the weights")


def vae_config_says_another_width(comfy) -> Case:
    return _config_case(comfy, "vae", "base_dim", 96, "base_dim is 96 there but 16 in the weights")


# ----------------------------------------------------------------------------- finite weights, overflowing sums


def finite_dit_that_overflows(comfy) -> Case:
    name = _single(comfy, "diffusion_models", DIT, "overflowing_dit.safetensors",
                   lambda t: bad.scale(t, "img_in.weight", 1e38))
    return Case(SAMPLER, ["NaN/Inf latents instead of an image", f"the DiT {name}", "nothing was saved"],
                load=_dit(name))


CASES = [
    nan_in_bf16_dit, nan_in_fp8_e4m3fn_dit, inf_scale_in_fp8_scaled_dit, inf_in_bf16_text_encoder,
    nan_in_fp8_scaled_text_encoder, nan_in_comfy_vae, nan_in_diffusers_dit_shard,
    inf_in_diffusers_text_encoder_shard, nan_in_diffusers_vae, nan_in_lora,
    first_block_missing, last_block_incomplete, last_block_incomplete_fp8_e4m3fn,
    text_encoder_layer_incomplete_fp8_scaled, released_width_dit_with_one_block,
    diffusers_folder_without_its_last_block,
    index_climbing_out, index_with_absolute_path, index_entry_linking_out, text_encoder_index_with_absolute_path,
    int_tensor_in_bf16_dit, bool_tensor_in_fp8_scaled_text_encoder, int_tensor_in_comfy_vae,
    int_tensor_in_diffusers_dit_shard, int_factor_in_lora,
    transformer_config_says_60_layers, text_encoder_config_says_28_layers, vae_config_says_another_width,
    finite_dit_that_overflows,
]


@pytest.mark.parametrize("make", CASES, ids=[case.__name__ for case in CASES])
def test_damaged_checkpoint_is_refused_and_the_next_prompt_runs(comfy, picture, baseline, make):
    case = make(comfy)
    chain = [fuse_lora(case.lora)] if case.lora else None
    node, message = failing_node(comfy, edit_prompt(picture, load=loader(**case.load), chain=chain, prefix="bad"))
    assert node == case.node, message
    for fragment in case.expected:
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert_server_still_works(comfy, picture, baseline)
