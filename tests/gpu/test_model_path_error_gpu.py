"""Whole-forward relative error of the two FP8 paths on one harness: ComfyUI's own Qwen-Image MODEL as the shipped
"ComfyUI core nodes + FP8" workflow sets it up, and the pack's own DiT with the fastest preset, each against its own
model in bf16 eager, with the same weights and the same inputs.

(a) ComfyUI's ``QwenImage`` (``comfy.supported_models.QwenImage``) in a real ``ModelPatcher``, through Apply TE-FP8
    and Compile Model with the widgets of example_workflows/api/qwen_edit_comfy_model_fp8.json (row-wise cuBLASLt
    fp8 on "attn+mlp+mod compute", modulation "fp8 storage", fast accumulation, cuDNN FP8 attention, ``model_block: pack
    fused``, compile default / dynamic), called as KSampler calls it (``BaseModel.apply_model`` with the MODEL's
    wrappers); reference: the same patcher in bf16 eager.
(b) The pack's DiT (DiffSynth's ``QwenImageDiT`` built by the pack's loader, ``create_dit``) with the widgets of
    example_workflows/api/qwen_edit_fastest.json (the same fp8 layers through ``build_config`` and
    ``build_fp8_dit``, attention cudnn_fp8, the fast forward ``fast_model_fn`` with the shipped ``ForwardOptions``,
    regional compile default / dynamic; CUDA graphs off, they replay the same kernels); reference: DiffSynth's
    ``model_fn_qwen_image`` on the same DiT in bf16 eager (the reference of bench/harness_forward.py's figures).

Shared: the weights and the inputs. The weights are drawn once into ComfyUI's model (tests/gpu/random_dit.py's
``randomize``: N(0, 1/fan_in), modulation and ``norm_out`` x0.1, norms 1, biases 0) and its ``diffusion_model``
state dict, whose names are Comfy-Org's single-file names, goes through the pack's single-file loading code
(``classify_keys`` for the prefix, ``infer_dit_config``, ``create_dit``, ``load_into``, ``finish``) into the pack's
DiT: every tensor the same values, no key renamed. The inputs are one set of tensors: the noisy target latent
(1, 16, 128, 128), one reference latent of the same size, two text states (positive and negative, 300 tokens each,
3584 wide) and sigma 0.5. ComfyUI gets them as ``x`` (2, 16, 1, 128, 128) (the latent twice), ``t`` = 0.5,
``c_crossattn`` (2, 300, 3584), ``ref_latents`` [(2, 16, 1, 128, 128)]; the pack as ``latents`` (the latent
expanded to batch 2), ``timestep`` 500 (DiffSynth's 0..1000 scale), the two prompts batched by ``batch_prompts``
(all-ones masks), ``edit_latents`` [the reference]; DiffSynth's reference runs the two prompts as two batch-1 calls.
Batch 2 = true CFG, one model call per path. Outputs compared: the velocity (the model's own output: for ComfyUI
recovered from ``apply_model``'s denoised output as (x - denoised) / sigma in float32; ``apply_model``'s own error
is printed too, the figure of test_comfy_model_gpu.py). The two networks differ in the MLP's GELU (ComfyUI: tanh
form; DiffSynth: x * sigmoid(1.702 x)), which is why each path is compared with its own bf16 model.
Relative error: ||out - ref|| / ||ref|| in float32 over the whole output (random_dit.py's ``rel_err``).

Sizes: dim 3072, 24 heads x 128, FFN 12288, text dim 3584, ``QWEN_COMFY_LAYERS`` blocks (default 8; bf16 about
0.34 B parameters, 0.68 GB, per block), 1024x1024 edit: 4096 target + 4096 reference image tokens and 300 text tokens
per sample, batch 2. The pack's DiT waits in host memory while ComfyUI's models are on the GPU. Timing is not
measured (test_comfy_model_gpu.py and bench/harness_forward.py time these paths). Prints a table and whether (a) is
no worse than (b) (not asserted); asserts both errors finite and below 0.1.

Run on the device machine (ComfyUI's source: ``QWEN_EDIT_COMFYUI_DIR``, default ``.testenv/comfyui``)::

    python3 -m pytest tests/gpu/test_model_path_error_gpu.py -m gpu -q -s
    # with the device set-up for ComfyUI 0.3.75:
    bash bench/product_path_device.sh gpu-test tests/gpu/test_model_path_error_gpu.py

The core (weight sharing, input conversion, both bf16 forwards, the emulated fp8 paths without compile) runs on the
CPU at a small width: ``_rehearse_on_cpu()`` (needs the pack imported as ``qwen_edit_hopper``, as tests/conftest.py
does).
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "unit"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfy_calls import sampler_model_options  # noqa: E402
from test_checkpoints_support import comfy as import_comfy  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYERS = int(os.environ.get("QWEN_COMFY_LAYERS", "8"))
WORKFLOWS = ROOT / "example_workflows" / "api"
COMFY_WORKFLOW = WORKFLOWS / "qwen_edit_comfy_model_fp8.json"
FASTEST_WORKFLOW = WORKFLOWS / "qwen_edit_fastest.json"
SIGMA = 0.5
"""ComfyUI's sigma (= its model's timestep for Qwen-Image); DiffSynth's timestep is 1000 x it."""
SANITY = 0.1
SOURCE = Path("<ComfyUI QwenImage diffusion_model state dict>")


@dataclass(frozen=True)
class Size:
    """Model width and the edit's size: ``dim`` = ``heads`` x head dim, ``text_dim``, ``layers`` blocks; a ``pixels``
    square edit with one reference of the same size and ``text_tokens`` per prompt."""

    dim: int
    heads: int
    text_dim: int
    layers: int
    pixels: int
    text_tokens: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def image_tokens(self) -> int:
        return (self.pixels // 16) ** 2


FULL = Size(dim=3072, heads=24, text_dim=3584, layers=LAYERS, pixels=1024, text_tokens=300)
SMALL = Size(dim=64, heads=2, text_dim=48, layers=2, pixels=64, text_tokens=7)


@dataclass(frozen=True)
class SharedInputs:
    """One edit's tensors, given to both paths: ``latent`` and ``reference`` (1, 16, P/8, P/8), ``texts`` (2, L, T)
    (positive, negative), ``sigma``."""

    latent: torch.Tensor
    reference: torch.Tensor
    texts: torch.Tensor
    sigma: float
    pixels: int


def _widgets(workflow: Path, class_type: str) -> dict:
    """The widget values of the one ``class_type`` node of an API workflow (links left out)."""
    nodes = [n for n in json.loads(workflow.read_text()).values() if n["class_type"] == class_type]
    assert len(nodes) == 1, f"{workflow.name}: {len(nodes)} {class_type} nodes"
    return {k: v for k, v in nodes[0]["inputs"].items() if not isinstance(v, list)}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    from random_dit import rel_err

    return rel_err(out, ref)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- the shared weights and inputs


def _comfy_patcher(comfy, size: Size, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """ComfyUI's Qwen-Image MODEL at ``size`` with random weights (random_dit.py's ``randomize``) on ``device``."""
    from qwen_edit_hopper.qwen_edit.checkpoints.dit import scaled_axes_dim
    from random_dit import randomize

    config = comfy.supported_models.QwenImage({
        "image_model": "qwen_image", "in_channels": 64, "num_layers": size.layers,
        "attention_head_dim": size.head_dim, "num_attention_heads": size.heads, "joint_attention_dim": size.text_dim,
        "axes_dims_rope": scaled_axes_dim(size.head_dim)})
    config.set_inference_dtype(dtype, None)
    model = config.get_model({}, device=device)
    randomize(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=torch.device("cpu"))


def _pack_dit(diffusion_model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """The pack's DiT (DiffSynth's ``QwenImageDiT`` at the size the tensors give) holding a copy of ComfyUI's
    ``diffusion_model`` tensors, through the pack's single-file loading code (prefix, config from shapes, strict
    load); the block count comes as a diffusers ``config.json`` would say it (a pruned model)."""
    from qwen_edit_hopper.qwen_edit.checkpoints import CheckpointKind, classify_keys
    from qwen_edit_hopper.qwen_edit.checkpoints.dit import create_dit, infer_dit_config
    from qwen_edit_hopper.qwen_edit.checkpoints.materialize import finish, load_into
    from qwen_edit_hopper.qwen_edit.checkpoints.shapes import strip_prefix

    state = diffusion_model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    found = classify_keys(shapes, shapes=shapes)
    assert found.kind == CheckpointKind.DIT, found.reason
    tensors = {strip_prefix(k, found.prefix): v.detach().to(device, copy=True) for k, v in state.items()}
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    blocks = diffusion_model.transformer_blocks
    attn = blocks[0].attn
    hf_config = {"num_layers": len(blocks), "attention_head_dim": attn.dim_head,
                 "num_attention_heads": attn.heads, "joint_attention_dim": shapes["txt_in.weight"][1],
                 "axes_dims_rope": list(diffusion_model.pe_embedder.axes_dim)}
    config = infer_dit_config(shapes, source=SOURCE, hf_config=hf_config)
    model = create_dit(config)
    load_into(model, tensors, source=SOURCE, what="the Qwen-Image DiT")
    return finish(model, device=device, source=SOURCE)


def _inputs(size: Size, device: torch.device | str, dtype: torch.dtype, seed: int = 1) -> SharedInputs:
    generator = torch.Generator("cpu").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    side = size.pixels // 8
    return SharedInputs(latent=randn(1, 16, side, side), reference=randn(1, 16, side, side),
                        texts=randn(2, size.text_tokens, size.text_dim), sigma=SIGMA, pixels=size.pixels)


def _comfy_call_inputs(shared: SharedInputs) -> dict:
    """``apply_model``'s arguments: batch 2 (positive, negative), 5-D latents, sigma, the reference as
    ``ref_latents`` (ComfyUI batches it with the conditions)."""
    batch = shared.texts.shape[0]
    return {"x": shared.latent[:, :, None].repeat(batch, 1, 1, 1, 1),
            "t": torch.full((batch,), shared.sigma, device=shared.latent.device),
            "c_crossattn": shared.texts,
            "ref_latents": [shared.reference[:, :, None].repeat(batch, 1, 1, 1, 1)]}


def _prompts(shared: SharedInputs) -> list[dict]:
    """The two texts as DiffSynth's prompt embedder gives them: (1, L, T) with an all-ones mask each."""
    mask = torch.ones(1, shared.texts.shape[1], dtype=torch.long, device=shared.texts.device)
    return [{"prompt_emb": shared.texts[i : i + 1], "prompt_emb_mask": mask} for i in range(shared.texts.shape[0])]


def _pack_call_inputs(shared: SharedInputs) -> dict:
    """``fast_model_fn``'s arguments as the pack's Sampler gives them for a batched true-CFG step."""
    from qwen_edit_hopper.qwen_edit.fast_forward import batch_prompts

    return {"latents": shared.latent.expand(shared.texts.shape[0], -1, -1, -1),
            "timestep": torch.full((1,), shared.sigma * 1000, device=shared.latent.device, dtype=shared.latent.dtype),
            "height": shared.pixels, "width": shared.pixels, "edit_latents": [shared.reference],
            **batch_prompts(_prompts(shared))}


# ----------------------------------------------------------------------------- the calls


def _comfy_velocity(comfy, patcher, shared: SharedInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(velocity (B, 16, H/8, W/8), ``apply_model``'s denoised output (B, 16, 1, H/8, W/8)), float32, of one
    ``apply_model`` call with the transformer options KSampler passes (the MODEL's own plus its wrappers and
    callbacks, as ``comfy.sampler_helpers.prepare_model_patcher`` adds them; without them no compile wrapper runs).
    ComfyUI's flow models return x - sigma * v."""
    inputs = _comfy_call_inputs(shared)
    comfy.model_management.load_models_gpu([patcher])
    options = sampler_model_options(patcher)["transformer_options"]
    with torch.inference_mode():
        denoised = patcher.model.apply_model(**inputs, transformer_options=options).float()
    comfy.model_management.unload_all_models()
    velocity = (inputs["x"].float() - denoised) / shared.sigma
    return velocity[:, :, 0], denoised


def _diffsynth_reference(dit: torch.nn.Module, shared: SharedInputs) -> torch.Tensor:
    """DiffSynth's ``model_fn_qwen_image`` on ``dit``, eager, one batch-1 call per prompt (it takes batch 1), float32
    (B, 16, H/8, W/8)."""
    from diffsynth.pipelines.qwen_image import model_fn_qwen_image

    timestep = torch.full((1,), shared.sigma * 1000, device=shared.latent.device, dtype=shared.latent.dtype)
    with torch.no_grad():
        outs = [model_fn_qwen_image(dit=dit, latents=shared.latent, timestep=timestep, height=shared.pixels,
                                    width=shared.pixels, edit_latents=[shared.reference], **prompt).float()
                for prompt in _prompts(shared)]
    return torch.cat(outs)


def _pack_fast(prepared, shared: SharedInputs, attention: str, choice=None) -> torch.Tensor:
    """The pack's fast forward (the Sampler's batched true-CFG call, shipped ``ForwardOptions``), float32."""
    from qwen_edit_hopper.qwen_edit.compile import compiled_forward_context
    from qwen_edit_hopper.qwen_edit.fast.options import SHIPPED
    from qwen_edit_hopper.qwen_edit.fast_forward import fast_model_fn

    with torch.no_grad(), compiled_forward_context(choice):
        return fast_model_fn(dit=prepared, attention_backend=attention, options=SHIPPED,
                             **_pack_call_inputs(shared)).float()


# ----------------------------------------------------------------------------- the two fp8 paths as shipped


def _shipped_comfy_model(patcher, where_unsupported: str | None = None, compile_blocks: bool = True):
    """(MODEL, report): Apply TE-FP8 then Compile Model on ``patcher`` with the shipped MODEL workflow's widgets
    (``where_unsupported`` replaced when given: emulate on the CPU); ``compile_blocks`` False skips Compile Model."""
    from qwen_edit_hopper.nodes.apply_fp8 import ApplyFP8
    from qwen_edit_hopper.nodes.compile_model import CompileModel

    widgets = _widgets(COMFY_WORKFLOW, "QwenEditHopper_ApplyFP8")
    assert widgets["model_block"] == "pack fused", widgets
    if where_unsupported is not None:
        widgets["where_unsupported"] = where_unsupported
    _, report, model = ApplyFP8.execute(**widgets, model=patcher).args
    if compile_blocks:
        _, compiled, model = CompileModel.execute(**_widgets(COMFY_WORKFLOW, "QwenEditHopper_Compile"),
                                                  model=model).args
        report += "\n" + compiled
    return model, report


def _fused_block_kernels(model):
    """The ``BlockKernels`` of the last fused block the MODEL ran (None: it never ran the pack's block)."""
    from qwen_edit_hopper.nodes.comfy_model.block_replace import PATCH_NAME, ReplacedBlock

    patches = model.model_options["transformer_options"]["patches_replace"][PATCH_NAME]
    shared = {patch.shared for patch in patches.values() if isinstance(patch, ReplacedBlock)}
    assert len(shared) == 1, shared
    return shared.pop().last_kernels


def _fastest_dit(dit: torch.nn.Module, where_unsupported: str | None = None, compile_blocks: bool = True):
    """(PreparedDit, attention, compile choice, fp8 config): the fastest workflow's Apply TE-FP8 widgets through the
    node's ``build_config``, the fp8 copy as the harness builds it (``build_fp8_dit``: the fp8 layers, the text
    stream's Q/K/V fused), the Load node's attention, Compile's mode and dynamic (CUDA graphs off)."""
    from qwen_edit_hopper.nodes.apply_fp8 import build_config
    from qwen_edit_hopper.nodes.load_qwen_edit import resolve_attention
    from qwen_edit_hopper.qwen_edit.compile import set_regional_compile
    from qwen_edit_hopper.qwen_edit.fast.prepared import PreparedDit
    from qwen_edit_hopper.qwen_edit.fp8_dit import build_fp8_dit
    from qwen_edit_hopper.qwen_edit.memory import Resident
    from qwen_edit_hopper.qwen_edit.plan import CompileChoice

    fp8 = _widgets(FASTEST_WORKFLOW, "QwenEditHopper_ApplyFP8")
    load = _widgets(FASTEST_WORKFLOW, "QwenEditHopper_Load")
    compile_widgets = _widgets(FASTEST_WORKFLOW, "QwenEditHopper_Compile")
    config, _ = build_config(fp8["backend"], fp8["te_recipe"], fp8["fp8_format"], fp8["amax_history_len"],
                             fp8["amax_compute_algo"], fp8["layers"], fp8["modulation"], fp8["fast_accum"],
                             fp8["gemm_kernel"], where_unsupported or fp8["where_unsupported"])
    attention, _, problem = resolve_attention(load["attention"], where_unsupported or load["where_unsupported"])
    assert problem is None, problem
    module = build_fp8_dit(dit, config)
    prepared = PreparedDit(module)
    choice = None
    if compile_blocks:
        choice = CompileChoice(mode=compile_widgets["mode"], dynamic=compile_widgets["dynamic"], cuda_graphs=False)
        set_regional_compile(Resident(key=("test",), module=module, nbytes=0, label="fastest", prepared=prepared),
                             choice)
    return prepared, attention, choice, config


def _comfy_modules():
    import_comfy()
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    return comfy


# ----------------------------------------------------------------------------- the test


def test_comfy_model_path_error_against_the_fastest_preset_on_one_harness():
    comfy = _comfy_modules()
    device = torch.device("cuda")
    base = _comfy_patcher(comfy, FULL, device, torch.bfloat16)
    dit = _pack_dit(base.model.diffusion_model, "cpu")  # waits in host memory while ComfyUI's models run
    shared = _inputs(FULL, device, torch.bfloat16)

    comfy_ref, comfy_ref_denoised = _comfy_velocity(comfy, base, shared)
    model, report = _shipped_comfy_model(base)
    comfy_out, comfy_out_denoised = _comfy_velocity(comfy, model, shared)
    kernels = _fused_block_kernels(model)
    error_a = _rel(comfy_out, comfy_ref)
    denoised_a = _rel(comfy_out_denoised, comfy_ref_denoised)
    del base, model
    comfy.model_management.unload_all_models()
    torch._dynamo.reset()
    _free()

    dit = dit.to(device)
    pack_ref = _diffsynth_reference(dit, shared)
    prepared, attention, choice, config = _fastest_dit(dit)
    del dit  # the fp8 copy holds its own tensors
    _free()
    try:
        pack_out = _pack_fast(prepared, shared, attention, choice)
    finally:
        torch._dynamo.reset()
    error_b = _rel(pack_out, pack_ref)
    plan = prepared.last_plan.summary() if prepared.last_plan is not None else "none"

    tokens = f"2 x ({FULL.image_tokens} target + {FULL.image_tokens} reference + {FULL.text_tokens} text)"
    rows = [("(a) ComfyUI QwenImage MODEL + Apply TE-FP8 (pack fused) + Compile Model", error_a),
            ("(b) pack DiT, fastest preset, fast forward compiled", error_b)]
    width = max(len(name) for name, _ in rows)
    print(f"\n{report}\n(a) fused block kernels: {kernels}\n(b) fp8: {config.describe()}; attention {attention}; "
          f"kernel plan: {plan}")
    print(f"{'path':<{width}} | rel. error vs its own bf16 eager | blocks | tokens")
    for name, error in rows:
        print(f"{name:<{width}} | {error:<32.3e} | {FULL.layers:>6} | {tokens}")
    print(f"(a) apply_model's denoised output (x - sigma v, test_comfy_model_gpu.py's figure): {denoised_a:.3e}")
    print(f"(a) <= (b): {error_a <= error_b} ((a) / (b) = {error_a / error_b:.2f})")
    assert kernels is not None, "the pack's fused block never ran on ComfyUI's MODEL"
    for name, error in rows:
        assert math.isfinite(error) and error < SANITY, (name, error)


# ----------------------------------------------------------------------------- CPU rehearsal


@contextmanager
def _diffsynth_tanh_gelu() -> Iterator[None]:
    """DiffSynth's MLP activation as ComfyUI's (tanh GELU) for the duration: the two networks are then the same."""
    from diffsynth.models import qwen_image_dit

    cls = qwen_image_dit.ApproximateGELU
    original = cls.forward
    cls.forward = lambda self, x: torch.nn.functional.gelu(self.proj(x), approximate="tanh")
    try:
        yield
    finally:
        cls.forward = original


def _rehearse_on_cpu(size: Size = SMALL) -> dict[str, float]:
    """The test's core on the CPU at ``size``: shared weights and inputs, the bf16 (and float32) forwards of both
    models against each other (with DiffSynth's GELU as it is, and as ComfyUI's), and both fp8 paths emulated
    (``where_unsupported: emulate``; no compile, no fused kernels) against their own references. Returns the
    relative errors by name."""
    comfy = _comfy_modules()
    device = torch.device("cpu")
    numbers: dict[str, float] = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        base = _comfy_patcher(comfy, size, device, dtype)
        dit = _pack_dit(base.model.diffusion_model, device)
        comfy_state = base.model.diffusion_model.state_dict()
        assert all(torch.equal(comfy_state[k], v) for k, v in dit.state_dict().items())
        shared = _inputs(size, device, dtype)
        comfy_v, _ = _comfy_velocity(comfy, base, shared)
        with torch.no_grad():
            inputs = _comfy_call_inputs(shared)
            direct = base.model.diffusion_model(inputs["x"], inputs["t"], inputs["c_crossattn"],
                                                ref_latents=inputs["ref_latents"], transformer_options={})
        numbers[f"{label}: ComfyUI velocity from apply_model vs its diffusion_model"] = _rel(comfy_v, direct[:, :, 0])
        pack_ref = _diffsynth_reference(dit, shared)
        numbers[f"{label}: DiffSynth vs ComfyUI (GELU forms differ)"] = _rel(pack_ref, comfy_v)
        with _diffsynth_tanh_gelu():
            numbers[f"{label}: DiffSynth with tanh GELU vs ComfyUI"] = _rel(_diffsynth_reference(dit, shared), comfy_v)
        numbers[f"{label}: pack fast forward, eager, sdpa, vs DiffSynth"] = _rel(
            _pack_fast(dit, shared, "sdpa"), pack_ref)
        if dtype == torch.float32:
            model, _ = _shipped_comfy_model(base, where_unsupported="emulate", compile_blocks=False)
            out, _ = _comfy_velocity(comfy, model, shared)
            assert _fused_block_kernels(model) is not None
            numbers[f"{label}: (a) emulated, no compile, vs ComfyUI"] = _rel(out, comfy_v)
            prepared, attention, _, _ = _fastest_dit(dit, where_unsupported="emulate", compile_blocks=False)
            numbers[f"{label}: (b) emulated ({attention}), no compile, vs DiffSynth"] = _rel(
                _pack_fast(prepared, shared, attention), pack_ref)
        comfy.model_management.unload_all_models()
    return numbers
