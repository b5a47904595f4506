"""Every layout loads through load_components and runs through DiffSynth's own code."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from qwen_edit_hopper.qwen_edit.checkpoints import (
    CheckpointError,
    ModelFiles,
    load_components,
    load_dit,
    load_processor,
    load_text_encoder,
    load_vae,
    resolve_diffusers_folder,
    resolve_single_files,
)
from qwen_edit_hopper.qwen_edit.tiny import TINY, tiny_configs
from safetensors.torch import load_file, save_file
from test_checkpoints_support import COMFY_TOKENIZER_DIR, tiny

CASES = ("diffusers", "comfy_bf16", "comfy_fp8")


def _files(case: str, tmp_path_factory) -> ModelFiles:
    if case == "diffusers":
        return resolve_diffusers_folder(tiny("diffusers", "edit_2509", tmp_path_factory)["root"])
    files = tiny("comfy_single", "edit_2509", tmp_path_factory)
    text_encoder = files["text_encoder"][0] if case == "comfy_bf16" else files["text_encoder_fp8"]
    return resolve_single_files(files["dit"][0], text_encoder, files["vae"][0])


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return {
        case: load_components(_files(case, tmp_path_factory), device="cpu", comfy_tokenizer_dir=COMFY_TOKENIZER_DIR)
        for case in CASES
    }


def _image(seed: int, size: int = 64) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _pipe(components):
    return SimpleNamespace(
        processor=components.processor,
        text_encoder=components.text_encoder,
        tokenizer=components.processor.tokenizer,
        device="cpu",
        torch_dtype=torch.bfloat16,
    )


def _to_tensor(image: Image.Image) -> torch.Tensor:
    array = np.array(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1)[None].to(torch.bfloat16)


@pytest.mark.parametrize("case", CASES)
def test_components_are_diffsynth_models_at_checkpoint_size(loaded, case):
    from diffsynth.models.qwen_image_dit import QwenImageDiT
    from diffsynth.models.qwen_image_text_encoder import QwenImageTextEncoder
    from diffsynth.models.qwen_image_vae import QwenImageVAE

    components = loaded[case]
    dit_config, text_config, vae_config = tiny_configs()
    assert isinstance(components.dit, QwenImageDiT) and components.dit.dit_config == dit_config
    assert isinstance(components.text_encoder, QwenImageTextEncoder)
    assert components.text_encoder.encoder_config == text_config
    assert isinstance(components.vae, QwenImageVAE) and components.vae.vae_config == vae_config
    assert components.variant.name == "edit_2509"
    for model in (components.dit, components.text_encoder, components.vae):
        assert not model.training
        assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
        assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("case", CASES)
def test_dit_forward_through_model_fn_qwen_image(loaded, case):
    from diffsynth.pipelines.qwen_image import model_fn_qwen_image

    dit = loaded[case].dit
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 8, 8, generator=generator).to(torch.bfloat16)
    edits = [torch.randn(1, 16, 8, 8, generator=generator).to(torch.bfloat16) for _ in range(2)]
    prompt = torch.randn(1, 7, TINY.text_hidden, generator=generator).to(torch.bfloat16)
    with torch.no_grad():
        for zero_cond_t in (False, True):
            out = model_fn_qwen_image(
                dit=dit,
                latents=latents,
                timestep=torch.tensor([500.0]),
                prompt_emb=prompt,
                prompt_emb_mask=torch.ones(1, 7, dtype=torch.long),
                height=64,
                width=64,
                edit_latents=edits,
                zero_cond_t=zero_cond_t,
            )
            assert out.shape == (1, 16, 8, 8)
            assert torch.isfinite(out.float()).all()
            assert out.float().std() > 1e-3


@pytest.mark.parametrize("case", CASES)
def test_vae_round_trip(loaded, case):
    vae = loaded[case].vae
    with torch.no_grad():
        latents = vae.encode(_to_tensor(_image(1, 32)))
        image = vae.decode(latents)
    assert latents.shape == (1, 16, 4, 4)
    assert image.shape == (1, 3, 32, 32)
    assert torch.isfinite(image.float()).all()
    assert image.float().std() > 1e-2  # a non-constant image


@pytest.mark.parametrize("case", CASES)
def test_prompt_encoding_with_images(loaded, case):
    from diffsynth.pipelines.qwen_image import QwenImageUnit_PromptEmbedder

    unit = QwenImageUnit_PromptEmbedder()
    pipe = _pipe(loaded[case])
    with torch.no_grad():
        (single,) = unit.encode_prompt_edit(pipe, ["make the sky red"], _image(2))
        (multi,) = unit.encode_prompt_edit_multi(pipe, ["swap them"], [_image(3), _image(4, 96)])
    for hidden in (single, multi):
        assert hidden.ndim == 2 and hidden.shape[1] == TINY.text_hidden
        assert torch.isfinite(hidden.float()).all()
    assert multi.shape[0] > single.shape[0]


def test_layouts_hold_the_same_weights(loaded):
    """Diffusers (sharded, HF names) and Comfy (single files, Comfy names) decode to the very same models."""
    diffusers, comfy = loaded["diffusers"], loaded["comfy_bf16"]
    for part in ("dit", "vae"):
        a, b = getattr(diffusers, part).state_dict(), getattr(comfy, part).state_dict()
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), part
    a, b = diffusers.text_encoder.state_dict(), comfy.text_encoder.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # DiffSynth reads hidden states only: lm_head (in the diffusers file, not in Comfy-Org's) is never built
    assert not hasattr(diffusers.text_encoder, "lm_head") and "lm_head.weight" not in a


def test_parts_load_alone(tmp_path_factory):
    files = _files("comfy_bf16", tmp_path_factory)
    assert load_dit(files, device="cpu").dit_config.num_layers == TINY.dit_layers
    assert load_vae(files, device="cpu", dtype=torch.float32).encoder.conv_in.weight.dtype == torch.float32
    assert load_text_encoder(files, device="cpu").encoder_config.vocab_size == TINY.vocab
    processor = load_processor(files, comfy_tokenizer_dir=COMFY_TOKENIZER_DIR)
    assert processor.image_processor.patch_size == 14


def test_missing_tokenizer_fails_before_any_weight(tmp_path_factory):
    files = _files("comfy_bf16", tmp_path_factory)
    with pytest.raises(CheckpointError, match=r"has no Qwen2\.5 tokenizer files") as info:
        load_components(files, device="cpu")
    assert "qwen25_tokenizer" in str(info.value)


def test_prefixed_dit_loads(tmp_path, tmp_path_factory):
    files = tiny("comfy_single", "edit_2509", tmp_path_factory)
    prefixed = tmp_path / "qwen_image_edit_2509_prefixed.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in load_file(str(files["dit"][0])).items()}, str(prefixed))
    model = load_dit(resolve_single_files(prefixed, files["text_encoder"][0], files["vae"][0]), device="cpu")
    assert model.dit_config == tiny_configs()[0]


def _live(cls) -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is cls)


def test_failure_names_keys_and_leaves_nothing_half_built(tmp_path, tmp_path_factory):
    from qwen_edit_hopper.qwen_edit.checkpoints.dit_model import SizedQwenImageDiT
    from qwen_edit_hopper.qwen_edit.checkpoints.text_encoder_model import SizedQwenImageTextEncoder

    files = tiny("comfy_single", "edit_2509", tmp_path_factory)
    broken = tmp_path / "qwen_2.5_vl_7b.safetensors"
    tensors = load_file(str(files["text_encoder"][0]))
    del tensors["model.norm.weight"]
    tensors["model.extra.weight"] = torch.zeros(1)
    save_file(tensors, str(broken))
    model_files = resolve_single_files(files["dit"][0], broken, files["vae"][0])

    before = (_live(SizedQwenImageDiT), _live(SizedQwenImageTextEncoder))
    with pytest.raises(CheckpointError) as info:
        load_components(model_files, device="cpu", comfy_tokenizer_dir=COMFY_TOKENIZER_DIR)
    message = str(info.value)
    assert message.startswith("qwen_2.5_vl_7b.safetensors does not match the Qwen2.5-VL text encoder")
    assert "1 missing keys ('model.language_model.norm.weight')" in message
    assert "1 unexpected keys ('model.language_model.extra.weight')" in message
    assert (_live(SizedQwenImageDiT), _live(SizedQwenImageTextEncoder)) == before
