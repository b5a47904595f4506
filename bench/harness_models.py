"""Models with random weights at full (or tiny) size, built in seconds, and the inputs and calls of each path.

* :func:`materialize_random`: a module built on ``meta`` -> ``dtype`` on ``device`` with random weights
  (``to_empty`` then in-place ``normal_``; tensors that were real before, such as rotary tables, are
  put back unchanged). Weight init: fan-in scaled Gaussians, norms 1, biases 0, modulation and
  ``norm_out`` weights x0.1 (the anchors' init).
* :func:`build_dit` / :func:`build_text_encoder` / :func:`build_vae`: the pack's DiffSynth-structured
  models at the released sizes (or the tiny test sizes).
* ComfyUI: :func:`comfy_key_map` maps DiffSynth DiT names to ComfyUI 0.3.75's
  ``QwenImageTransformer2DModel`` names (the identity: both use the diffusers names; the map checks
  the two key sets and shapes so a future rename fails loudly) and :func:`build_comfy_model` gives
  ComfyUI's model the *same* tensors (shared storage: no second copy of 38 GiB).
* :class:`ForwardInputs` and the three calls: DiffSynth's ``model_fn_qwen_image``, the pack's
  ``fast_model_fn`` (batch 1 or batched CFG), ComfyUI's model.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from harness_core import ROOT, free_memory, load_pack

load_pack()

SMALL_INIT = ("_mod.", "norm_out.")
"""Parameters drawn 10x smaller: modulation and the final AdaLayerNorm (keeps 60 blocks finite)."""

FULL = "full"
TINY = "tiny"


# ----------------------------------------------------------------------------- random weights


def fan_in(shape: tuple[int, ...]) -> int:
    """Inputs per output of a weight: ``prod(shape[1:])`` (linear: in_features; conv: in * kernel)."""
    return max(1, math.prod(shape[1:]))


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int = 0, small: tuple[str, ...] = SMALL_INIT) -> None:
    """Fill every parameter in place: weights (>= 2-D) N(0, 1/fan_in), x0.1 for names containing any of
    ``small``; 1-D norm weights / gammas 1; other 1-D parameters (biases) 0.

    One generator per device, seeded with ``seed``: the same module and seed give the same weights.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in module.named_parameters():
        if param.is_meta:
            raise ValueError(f"randomize_: {name} is on meta; materialize it first (to_empty)")
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        random_fill_(name, param, gen, small)


@torch.no_grad()
def random_fill_(name: str, tensor: torch.Tensor, generator: torch.Generator,
                 small: tuple[str, ...] = SMALL_INIT) -> torch.Tensor:
    """Fill one tensor in place by :func:`randomize_`'s rule for a parameter called ``name``; returns it.

    ``tensor`` and ``generator`` must be on the same device; any floating dtype.
    """
    if tensor.ndim >= 2:
        std = 1.0 / math.sqrt(fan_in(tuple(tensor.shape)))
        if any(s in name for s in small):
            std *= 0.1
        return tensor.normal_(0.0, std, generator=generator)
    if "norm" in name or name.endswith("gamma"):
        return tensor.fill_(1.0)
    return tensor.zero_()


def _set_tensor(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._buffers[leaf] = value


@torch.no_grad()
def materialize_random(module: torch.nn.Module, device: torch.device | str, dtype: torch.dtype,
                       seed: int = 0) -> torch.nn.Module:
    """A module built on ``meta`` -> ``dtype`` on ``device`` with random weights, in place; returns it.

    The cast to ``dtype`` happens on ``meta`` (free), so a 20 B-parameter DiT never exists in
    float32. Buffers that were real tensors before (rotary ``inv_freq`` built on the CPU) are restored
    with their own dtype on ``device``; plain tensor attributes (DiffSynth's RoPE tables, the VAE's
    latent mean/std) are left as they are (their owners move them per call). Raises RuntimeError if a
    tensor is still on ``meta`` afterwards.
    """
    load_pack()
    from qwen_edit_hopper.qwen_edit.checkpoints.materialize import find_meta_tensors

    device = torch.device(device)
    real_buffers = {name: b for name, b in module.named_buffers() if not b.is_meta}
    module.to(dtype)
    module.to_empty(device=device)
    randomize_(module, seed)
    for name, buffer in real_buffers.items():
        _set_tensor(module, name, buffer.to(device))
    leftover = find_meta_tensors(module)
    if leftover:
        raise RuntimeError(f"{type(module).__name__} still has meta tensors after materialize: {leftover[:5]}")
    return module.eval().requires_grad_(False)


def structure_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of the module tree whose parameters and buffers are the originals (no tensor copied).

    Swapping a child module or a parameter in the copy leaves the original alone; changing a shared
    tensor in place would not.
    """
    memo: dict[int, Any] = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return copy.deepcopy(module, memo)


# ----------------------------------------------------------------------------- configs and builders


def configs(size: str = FULL):
    """(DiTConfig, TextEncoderConfig, VAEConfig) at the released sizes (``full``) or the tiny test sizes."""
    load_pack()
    from qwen_edit_hopper.qwen_edit.checkpoints.dit import DiTConfig
    from qwen_edit_hopper.qwen_edit.checkpoints.text_encoder import TextEncoderConfig
    from qwen_edit_hopper.qwen_edit.checkpoints.vae import VAEConfig
    from qwen_edit_hopper.qwen_edit.tiny import tiny_configs

    if size == TINY:
        return tiny_configs()
    if size != FULL:
        raise ValueError(f"size must be {FULL!r} or {TINY!r}, got {size!r}")
    dit = DiTConfig(dim=3072, num_layers=60, num_heads=24, head_dim=128, text_dim=3584)
    return dit, TextEncoderConfig(), VAEConfig()


def build_dit(size: str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """The pack's ``SizedQwenImageDiT`` (DiffSynth's blocks) with random weights."""
    from qwen_edit_hopper.qwen_edit.checkpoints.dit import create_dit

    return materialize_random(create_dit(configs(size)[0]), device, dtype, seed)


def fastest_fp8_dit(base: torch.nn.Module, fused_qkv: tuple[str, ...] | None = None):
    """The fastest preset's DiT built from ``base`` (row-wise scaled-mm, "attn+mlp+mod compute", fast
    accumulation, the workspace-free cuBLASLt GEMM call, the text stream's Q/K/V fused unless ``fused_qkv``
    names other streams), as a ``PreparedDit`` with the pack's regional compile (blocks compiled on first use;
    the module is its ``.module``). ``base`` stays as it is; the caller drops it when done with it."""
    from qwen_edit_hopper.fp8 import Fp8Config
    from qwen_edit_hopper.qwen_edit.fast.prepared import PreparedDit
    from qwen_edit_hopper.qwen_edit.fp8_dit import build_fp8_dit

    module = build_fp8_dit(base, Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute",
                                           fast_accum=True, gemm_kernel="cublaslt"), fused_qkv)  # fmt: skip
    prepared = PreparedDit(module)
    prepared.compile_blocks()
    return prepared


def fastest_fp8_dit_at_full_size(device: torch.device) -> tuple[Any, ForwardInputs]:
    """:func:`fastest_fp8_dit` of a full-size random DiT (the bf16 base is dropped and its memory freed), and the
    1024x1024 edit's inputs (one reference image, 300 text tokens)."""
    base = build_dit(FULL, device)
    inputs = ForwardInputs.make(1024, 1024, 300, 3584, device)
    module = fastest_fp8_dit(base)
    del base
    free_memory()
    return module, inputs


def build_text_encoder(size: str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, seed: int = 1):
    """Qwen2.5-VL (language model + vision tower + lm_head) with random weights."""
    from qwen_edit_hopper.qwen_edit.checkpoints.text_encoder import create_text_encoder

    return materialize_random(create_text_encoder(configs(size)[1]), device, dtype, seed)


def build_vae(size: str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, seed: int = 2):
    """DiffSynth's ``QwenImageVAE`` with random weights."""
    from qwen_edit_hopper.qwen_edit.checkpoints.vae import create_vae

    return materialize_random(create_vae(configs(size)[2]), device, dtype, seed)


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ----------------------------------------------------------------------------- ComfyUI


def comfy_dir() -> Path:
    """ComfyUI's source folder: ``$COMFY_DIR``, default ``.comfy_src`` in the repository root."""
    path = Path(os.environ.get("COMFY_DIR", ".comfy_src"))
    return path if path.is_absolute() else ROOT / path


@contextlib.contextmanager
def _process_flags_kept():
    """Restore the torch backend flags ComfyUI's import may change (SDPA kernels, math-SDPA reduction,
    cuDNN benchmark, fp16 accumulation)."""
    cuda = torch.backends.cuda
    flags = [(cuda.enable_math_sdp, cuda.math_sdp_enabled), (cuda.enable_flash_sdp, cuda.flash_sdp_enabled),
             (cuda.enable_mem_efficient_sdp, cuda.mem_efficient_sdp_enabled)]
    if hasattr(cuda, "fp16_bf16_reduction_math_sdp_allowed"):
        flags.append((cuda.allow_fp16_bf16_reduction_math_sdp, cuda.fp16_bf16_reduction_math_sdp_allowed))
    saved = [(setter, getter()) for setter, getter in flags]
    benchmark = torch.backends.cudnn.benchmark
    accumulation = getattr(cuda.matmul, "allow_fp16_accumulation", None)
    try:
        yield
    finally:
        for setter, value in saved:
            setter(value)
        torch.backends.cudnn.benchmark = benchmark
        if accumulation is not None:
            cuda.matmul.allow_fp16_accumulation = accumulation


def import_comfy(device: torch.device | str) -> SimpleNamespace:
    """ComfyUI's ops, model management, attention module and Qwen model class, from :func:`comfy_dir`.

    ``comfy.cli_args.args`` is set for this device (``cpu`` off on CUDA) before
    ``comfy.model_management`` is imported (it reads the args at import). Raises FileNotFoundError
    naming the folder when the source is not there.
    """
    folder = comfy_dir()
    if not (folder / "comfy" / "ldm" / "qwen_image" / "model.py").is_file():
        raise FileNotFoundError(f"ComfyUI source not found at {folder} (set COMFY_DIR to a ComfyUI checkout)")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    import comfy.cli_args

    comfy.cli_args.args.cpu = torch.device(device).type != "cuda"
    with _process_flags_kept():  # ComfyUI sets SDPA / cuDNN flags at import: keep them out of later measurements
        import comfy.ldm.modules.attention as attention
        import comfy.model_management as model_management
        import comfy.ops as ops
        from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    return SimpleNamespace(ops=ops, mm=model_management, attention=attention, model_cls=QwenImageTransformer2DModel,
                           folder=folder)


def comfy_model_kwargs(config) -> dict[str, Any]:
    """``QwenImageTransformer2DModel`` arguments for a :class:`DiTConfig` (ComfyUI's out_channels are
    latent channels; its proj_out has patch^2 times that)."""
    return {"num_layers": config.num_layers, "attention_head_dim": config.head_dim,
            "num_attention_heads": config.num_heads, "joint_attention_dim": config.text_dim,
            "axes_dims_rope": tuple(config.axes_dim), "in_channels": config.in_channels,
            "out_channels": config.out_channels // 4}


def comfy_key_map(diffsynth_shapes: dict[str, tuple[int, ...]], comfy_shapes: dict[str, tuple[int, ...]]
                  ) -> dict[str, str]:
    """DiffSynth DiT name -> ComfyUI ``QwenImageTransformer2DModel`` name.

    Both follow the diffusers names, so the map is the identity; it is checked, not assumed: every
    key must exist on both sides with the same shape. Raises ValueError listing the differences.
    """
    only_ds = sorted(set(diffsynth_shapes) - set(comfy_shapes))
    only_comfy = sorted(set(comfy_shapes) - set(diffsynth_shapes))
    wrong = sorted(k for k in set(diffsynth_shapes) & set(comfy_shapes)
                   if tuple(diffsynth_shapes[k]) != tuple(comfy_shapes[k]))
    if only_ds or only_comfy or wrong:
        raise ValueError(f"DiffSynth and ComfyUI Qwen DiT names differ: only DiffSynth {only_ds[:5]}, "
                         f"only ComfyUI {only_comfy[:5]}, shape mismatches {wrong[:5]}")
    return {k: k for k in diffsynth_shapes}


def _shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}


@torch.no_grad()
def build_comfy_model(base: torch.nn.Module, comfy: SimpleNamespace, operations, *,
                      dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """ComfyUI's ``QwenImageTransformer2DModel`` holding ``base``'s tensors (shared storage, no copy).

    ``base`` is a ``SizedQwenImageDiT``; ``operations`` one of ComfyUI's ops classes
    (``comfy.ops.disable_weight_init`` for bf16, ``comfy.ops.fp8_ops`` for fp8_e4m3fn_fast, see
    :func:`to_comfy_fp8`).
    """
    load_pack()
    from qwen_edit_hopper.qwen_edit.checkpoints.materialize import find_meta_tensors

    with torch.device("meta"):
        model = comfy.model_cls(**comfy_model_kwargs(base.dit_config), dtype=dtype, operations=operations)
    mapping = comfy_key_map(_shapes(base), _shapes(model))
    state = {mapping[k]: v for k, v in base.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)
    leftover = find_meta_tensors(model)
    if leftover:
        raise RuntimeError(f"ComfyUI model still has meta tensors: {leftover[:5]}")
    return model.eval().requires_grad_(False)


@torch.no_grad()
def to_comfy_fp8(model: torch.nn.Module, comfy: SimpleNamespace) -> int:
    """ComfyUI's fp8_e4m3fn_fast weights: every ``fp8_ops.Linear`` in the blocks cast to float8_e4m3fn with no
    scale (what ComfyUI's ``weight_dtype fp8_e4m3fn_fast`` stores); new tensors, the shared bf16 ones are
    left alone. Returns the number of layers cast."""
    count = 0
    for block in model.transformer_blocks:
        for module in block.modules():
            if isinstance(module, comfy.ops.fp8_ops.Linear):
                module.weight = torch.nn.Parameter(module.weight.detach().to(torch.float8_e4m3fn),
                                                   requires_grad=False)
                count += 1
    return count


# ----------------------------------------------------------------------------- inputs and calls


@dataclass
class ForwardInputs:
    """DiT inputs of one edit at ``height`` x ``width`` with one reference image of the same size.

    latents, edit: (1, 16, H/8, W/8); prompt / negative: (1, L, text_dim) with all-ones masks (1, L);
    timestep: (1,) = 500 on DiffSynth's 0..1000 scale. Gaussian values (never zeros).
    """

    height: int
    width: int
    latents: torch.Tensor
    edit: torch.Tensor
    prompt: torch.Tensor
    prompt_mask: torch.Tensor
    negative: torch.Tensor
    negative_mask: torch.Tensor
    timestep: torch.Tensor

    @classmethod
    def make(cls, height: int, width: int, text_tokens: int, text_dim: int, device: torch.device | str,
             dtype: torch.dtype = torch.bfloat16, seed: int = 1, negative_tokens: int | None = None) -> ForwardInputs:
        gen = torch.Generator("cpu").manual_seed(seed)
        neg_tokens = negative_tokens or text_tokens

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        return cls(
            height=height, width=width,
            latents=randn(1, 16, height // 8, width // 8), edit=randn(1, 16, height // 8, width // 8),
            prompt=randn(1, text_tokens, text_dim),
            prompt_mask=torch.ones(1, text_tokens, dtype=torch.long, device=device),
            negative=randn(1, neg_tokens, text_dim),
            negative_mask=torch.ones(1, neg_tokens, dtype=torch.long, device=device),
            timestep=torch.full((1,), 500.0, device=device, dtype=dtype),
        )

    @property
    def image_tokens(self) -> int:
        return 2 * (self.height // 16) * (self.width // 16)

    def batched_text(self, ff) -> dict[str, Any]:
        """``[prompt, negative]`` right-padded into one batch by ``fast_forward.batch_prompts`` (made once, as
        the pack's sampler does before its loop)."""
        cached = self.__dict__.get("_batched")
        if cached is None:
            cached = ff.batch_prompts([{"prompt_emb": self.prompt, "prompt_emb_mask": self.prompt_mask},
                                       {"prompt_emb": self.negative, "prompt_emb_mask": self.negative_mask}])
            self.__dict__["_batched"] = cached
        return cached

    def with_timestep(self, value: float) -> ForwardInputs:
        return ForwardInputs(self.height, self.width, self.latents, self.edit, self.prompt, self.prompt_mask,
                             self.negative, self.negative_mask, torch.full_like(self.timestep, value))


def diffsynth_forward(dit: torch.nn.Module, inputs: ForwardInputs, *, negative: bool = False,
                      grad: bool = False) -> torch.Tensor:
    """DiffSynth's ``model_fn_qwen_image`` (batch 1); ``grad=True`` runs outside ``no_grad``
    (DelayedScaling calibration needs grad mode)."""
    from diffsynth.pipelines.qwen_image import model_fn_qwen_image

    emb, mask = (inputs.negative, inputs.negative_mask) if negative else (inputs.prompt, inputs.prompt_mask)
    context = torch.enable_grad() if grad else torch.no_grad()
    with context:
        return model_fn_qwen_image(dit=dit, latents=inputs.latents, timestep=inputs.timestep, prompt_emb=emb,
                                   prompt_emb_mask=mask, height=inputs.height, width=inputs.width,
                                   edit_latents=[inputs.edit])


def diffsynth_cfg_step(dit: torch.nn.Module, inputs: ForwardInputs, cfg: float = 4.0) -> torch.Tensor:
    """One true-CFG step as DiffSynth and the pack's sampler run it: two batch-1 forwards, then combine."""
    positive = diffsynth_forward(dit, inputs)
    negative = diffsynth_forward(dit, inputs, negative=True)
    return negative + cfg * (positive - negative)


def fast_forward(ff, dit, inputs: ForwardInputs, *, batch: int = 1, attention: str = "sdpa",
                 negative: bool = False, zero_cond_t: bool = False, options=None) -> torch.Tensor:
    """The pack's ``fast_model_fn`` on ``dit`` (a ``PreparedDit``, or a module run eagerly): batch 1 (prompt, or
    negative), or batch 2 = [prompt, negative]. ``zero_cond_t``: Qwen-Image-Edit-2511's reference-token modulation
    (timestep 0 for the reference tokens); ``options``: a ``ForwardOptions`` (None: the shipped ones)."""
    shared = {"timestep": inputs.timestep, "height": inputs.height, "width": inputs.width,
              "edit_latents": [inputs.edit], "attention_backend": attention, "zero_cond_t": zero_cond_t}
    if options is not None:
        shared["options"] = options
    with torch.no_grad():
        if batch == 1:
            emb, mask = (inputs.negative, inputs.negative_mask) if negative else (inputs.prompt, inputs.prompt_mask)
            return ff.fast_model_fn(dit=dit, latents=inputs.latents, prompt_emb=emb, prompt_emb_mask=mask, **shared)
        latents = inputs.latents.expand(2, -1, -1, -1)
        return ff.fast_model_fn(dit=dit, latents=latents, **inputs.batched_text(ff), **shared)


def fast_cfg_step(ff, dit, inputs: ForwardInputs, *, attention: str = "sdpa", cfg: float = 4.0) -> torch.Tensor:
    """One true-CFG step with cond and uncond in one batch-2 forward, then combine."""
    positive, negative = fast_forward(ff, dit, inputs, batch=2, attention=attention).chunk(2)
    return negative + cfg * (positive - negative)


def comfy_forward(model: torch.nn.Module, inputs: ForwardInputs) -> torch.Tensor:
    """ComfyUI's model on the same inputs: 5-D latents, timestep on 0..1, the reference as ``ref_latents``."""
    with torch.no_grad():
        out = model(inputs.latents[:, :, None], inputs.timestep / 1000, inputs.prompt,
                    ref_latents=[inputs.edit[:, :, None]], transformer_options={})
    return out[:, :, 0]


def regional_compile(blocks: Iterable[torch.nn.Module], dynamic: bool | None = False) -> None:
    """The anchors' compile for ComfyUI and torchao: ``torch.compile(block._call_impl)`` set per block
    (what ``block.compile()`` does), undone by :func:`regional_uncompile`."""
    for block in blocks:
        block._compiled_call_impl = torch.compile(block._call_impl, dynamic=dynamic)


def regional_uncompile(blocks: Iterable[torch.nn.Module]) -> None:
    for block in blocks:
        block._compiled_call_impl = None
