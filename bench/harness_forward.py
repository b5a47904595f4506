"""Per DiT forward, per true-CFG step, per resolution and per single linear: every preset of the pack and the
anchors, one base.

Families, each a list of groups (one model built per group, several modes measured on it, then freed):

* ``ds``: DiffSynth's ``model_fn_qwen_image`` on the pack's DiT (the baseline every figure is compared
  with, and DiffSynth's own path with the pack's fp8 linears): bf16 eager / compiled, fp8 variants from
  ``build_fp8_dit`` (scaled_mm row-wise eager / compiled, weight-only eager, TE current / block /
  delayed-calibrated eager). Compiled = the anchors' regional compile, ``torch.compile(block._call_impl,
  dynamic=False)`` per block (DiffSynth calls the block modules).
* ``fast``: the pack's own forward, ``qwen_edit.fast_forward.fast_model_fn`` (what the pack's sampler
  runs), compiled through the pack's ``qwen_edit.compile.set_regional_compile`` with the run's
  ``CompileChoice``: bf16 eager / compiled, fp8 row-wise eager / compiled, + fused QKV, + triton_fp8
  attention, tensor-wise compiled, TE current compiled, weight-only eager; batch 2 for true CFG.
* ``comfy``: ComfyUI's core ``QwenImageTransformer2DModel`` on the *same* tensors: bf16 eager /
  compiled, fp8_e4m3fn_fast eager / compiled. Errors against reference B (ComfyUI bf16 eager).
* ``torchao``: torchao float8 dynamic row-wise on the blocks, eager / compiled.

Memory: one bf16 base DiT lives for the whole run; an fp8 variant (about 20 GiB at full size) is
built from it, measured and freed before the next. ``torch._dynamo.reset()`` runs after each
compiled group (its graphs are of no further use) and between families.

The single-linear part is ``harness_linear.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import harness_models as hm
import torch
from harness_core import (
    NOT_RUN,
    OK,
    UNAVAILABLE,
    PeakProbe,
    Runner,
    free_memory,
    guarded,
    load_pack,
    log,
    relative_error,
    tensor_gib,
    time_calls,
)

load_pack()

CFG_SCALE = 4.0
FAMILIES = ("ds", "fast", "comfy", "torchao")


@dataclass(frozen=True)
class Sizes:
    """Resolutions and prompt length of a run (``full`` = the 1024x1024 edit with one reference image)."""

    forward: tuple[int, int] = (1024, 1024)
    resolutions: tuple[tuple[int, int], ...] = ((512, 512), (1328, 1328))
    text_tokens: int = 300
    negative_tokens: int = 287
    warmup: int = 2
    reps: int = 6

    @classmethod
    def tiny(cls) -> Sizes:
        return cls(forward=(64, 64), resolutions=((32, 32), (96, 96)), text_tokens=8, negative_tokens=5, warmup=1,
                   reps=2)


@dataclass
class ForwardContext:
    """What the families share: device, sizes, the base DiT, references, compile settings."""

    device: torch.device
    dtype: torch.dtype
    size: str
    sizes: Sizes
    runner: Runner
    compile_choice: Any
    no_compile: bool = False
    negative_tokens: int | None = None
    compile_estimate_s: float = 120.0
    base: torch.nn.Module | None = None
    _inputs: dict[tuple[int, int], hm.ForwardInputs] = field(default_factory=dict)
    _refs: dict[tuple, torch.Tensor] = field(default_factory=dict)
    _fast: tuple[Any, str] | None = None
    _prepared: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    def prepared(self, module: torch.nn.Module):
        """The ``PreparedDit`` this run keeps for ``module`` (compile choice, CUDA graphs, kernel plans)."""
        if module not in self._prepared:
            self._prepared[module] = self.fast()[0].PreparedDit(module)
        return self._prepared[module]

    # --- base and inputs
    def get_base(self) -> torch.nn.Module:
        if self.base is None:
            log(f"building the base DiT ({self.size}, random weights) on {self.device}")
            self.base = hm.build_dit(self.size, self.device, self.dtype)
            log(f"base DiT: {hm.parameter_count(self.base) / 1e9:.2f} B parameters, {tensor_gib(self.base):.1f} GiB")
        return self.base

    def inputs(self, hw: tuple[int, int] | None = None) -> hm.ForwardInputs:
        hw = hw or self.sizes.forward
        if hw not in self._inputs:
            text_dim = self.get_base().dit_config.text_dim
            self._inputs[hw] = hm.ForwardInputs.make(hw[0], hw[1], self.sizes.text_tokens, text_dim, self.device,
                                                     self.dtype,
                                                     negative_tokens=self.negative_tokens or self.sizes.negative_tokens)
        return self._inputs[hw]

    def tokens(self, hw: tuple[int, int]) -> int:
        return self.inputs(hw).image_tokens + self.sizes.text_tokens

    @contextlib.contextmanager
    def _base_eager(self):
        """The base's blocks uncompiled for the duration (a reference must be eager)."""
        blocks = list(self.get_base().transformer_blocks)
        saved = [b._compiled_call_impl for b in blocks]
        for b in blocks:
            b._compiled_call_impl = None
        try:
            yield self.base
        finally:
            for b, call in zip(blocks, saved, strict=True):
                b._compiled_call_impl = call

    def reference(self, hw: tuple[int, int] | None = None) -> torch.Tensor:
        """Reference A: DiffSynth bf16 eager output of the base (float32), per resolution."""
        hw = hw or self.sizes.forward
        key = ("A", hw)
        if key not in self._refs:
            with self._base_eager() as base:
                self._refs[key] = hm.diffsynth_forward(base, self.inputs(hw)).float()
        return self._refs[key]

    def cfg_reference(self) -> torch.Tensor:
        """DiffSynth bf16 eager true-CFG step output (float32)."""
        key = ("cfg", self.sizes.forward)
        if key not in self._refs:
            with self._base_eager() as base:
                self._refs[key] = hm.diffsynth_cfg_step(base, self.inputs(), CFG_SCALE).float()
        return self._refs[key]

    def set_ref(self, key: tuple, value: torch.Tensor) -> None:
        self._refs[key] = value

    def get_ref(self, key: tuple) -> torch.Tensor | None:
        return self._refs.get(key)

    def fast(self) -> tuple[Any, str]:
        """(``qwen_edit.fast_forward`` module or None, reason)."""
        if self._fast is None:
            self._fast = load_fast_forward()
        return self._fast

    def release(self) -> None:
        self._refs.clear()
        self._inputs.clear()
        self.base = None
        free_memory()


FAST_NEEDS = ("fast_model_fn", "batch_prompts", "PreparedDit", "fuse_qkv", "FUSED_QKV_PATTERN")


def load_fast_forward() -> tuple[Any, str]:
    """The pack's ``qwen_edit.fast_forward`` if it imports and has what the harness calls."""
    try:
        ff = importlib.import_module("qwen_edit_hopper.qwen_edit.fast_forward")
    except Exception as exc:  # absent or broken: its variants are reported unavailable with this reason
        return None, f"qwen_edit.fast_forward does not import: {type(exc).__name__}: {exc}"
    missing = [name for name in FAST_NEEDS if not hasattr(ff, name)]
    if missing:
        return None, f"qwen_edit.fast_forward lacks {', '.join(missing)}"
    return ff, "qwen_edit.fast_forward imports"


# ----------------------------------------------------------------------------- modes and groups


@dataclass
class Mode:
    """One way of running a built model: a variant id, how to call it, and how to switch it on/off."""

    name: str
    kind: str  # "ds", "fast" or "comfy": which call
    compiled: bool = False
    attention: str = "sdpa"
    cfg: bool = False
    resolution: bool = False
    reference: str = "A"  # "A" (DiffSynth bf16 eager) or "B" (ComfyUI bf16 eager)
    enter: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None


@dataclass
class Group:
    family: str
    name: str
    build: Callable[[ForwardContext], torch.nn.Module]
    modes: list[Mode]
    note: str = ""
    shares_base: bool = False  # the module is the base itself: nothing to free


def vid(group: Group, mode: Mode) -> str:
    return f"{group.family}/{mode.name}"


def measurement_ids(group: Group, mode: Mode, sizes: Sizes) -> list[str]:
    v = vid(group, mode)
    ids = [f"forward/{v}"]
    if mode.cfg:
        ids.append(f"cfg/{v}")
    if mode.resolution:
        ids += [f"resolution/{v}@{h}x{w}" for h, w in sizes.resolutions]
    return ids


def _call(ctx: ForwardContext, module, mode: Mode, inputs: hm.ForwardInputs) -> torch.Tensor:
    if mode.kind == "ds":
        return hm.diffsynth_forward(module, inputs)
    if mode.kind == "fast":
        return hm.fast_forward(ctx.fast()[0], ctx.prepared(module), inputs, attention=mode.attention)
    if mode.kind == "comfy":
        return hm.comfy_forward(module, inputs)
    raise ValueError(f"unknown call kind {mode.kind!r}")


def _cfg_step(ctx: ForwardContext, module, mode: Mode, inputs: hm.ForwardInputs) -> torch.Tensor:
    if mode.kind == "ds":
        return hm.diffsynth_cfg_step(module, inputs, CFG_SCALE)
    if mode.kind == "fast":
        return hm.fast_cfg_step(ctx.fast()[0], ctx.prepared(module), inputs, attention=mode.attention, cfg=CFG_SCALE)
    raise ValueError(f"no CFG step for call kind {mode.kind!r}")


def _reference(ctx: ForwardContext, mode: Mode, hw: tuple[int, int]) -> tuple[torch.Tensor | None, str]:
    if mode.reference == "B":
        ref = ctx.get_ref(("B", hw))
        return ref, "reference B: ComfyUI core bf16 eager, same weights and inputs"
    return ctx.reference(hw), "reference A: DiffSynth bf16 eager (model_fn_qwen_image), same weights and inputs"


# ----------------------------------------------------------------------------- measurements


def measure_forward(ctx: ForwardContext, module, mode: Mode, weights_gib: float, hw: tuple[int, int] | None = None
                    ) -> dict[str, Any]:
    hw = hw or ctx.sizes.forward
    inputs = ctx.inputs(hw)
    ref, _ = _reference(ctx, mode, hw)
    with PeakProbe(ctx.device) as probe:
        timing = time_calls(lambda: _call(ctx, module, mode, inputs), ctx.device, warmup=ctx.sizes.warmup,
                            reps=ctx.sizes.reps)
    out = _call(ctx, module, mode, inputs).float()
    figures = {**timing, "rel_err": relative_error(out, ref) if ref is not None else None,
               "height": hw[0], "width": hw[1], "tokens": ctx.tokens(hw), **probe.figures(),
               "weights_gib": weights_gib}
    figures["standalone_peak_gib"] = weights_gib + figures["activation_peak_gib"]
    if mode.kind == "fast":
        figures["kernels"] = ctx.prepared(module).last_plan.summary()
    return figures


def measure_cfg(ctx: ForwardContext, module, mode: Mode, forward_ms: float | None = None) -> dict[str, Any]:
    """Step = one true-CFG step (two batch-1 forwards for ds, one batch-2 for fast, plus the combine);
    forward = one batch-1 forward of the same path (``forward_ms`` when this run just measured it, else
    timed here); ratio = step / forward (target <= 1.9 for batch 2). The negative prompt has
    ``negative_tokens`` tokens (right-padded in the batch)."""
    inputs = ctx.inputs()
    with PeakProbe(ctx.device) as probe:
        step = time_calls(lambda: _cfg_step(ctx, module, mode, inputs), ctx.device, warmup=ctx.sizes.warmup,
                          reps=ctx.sizes.reps)
    if forward_ms is None:
        forward_ms = time_calls(lambda: _call(ctx, module, mode, inputs), ctx.device, warmup=1,
                                reps=ctx.sizes.reps)["ms"]
    out = _cfg_step(ctx, module, mode, inputs).float()
    figures = {"step_ms": step["ms"], "forward_ms": forward_ms, "step_per_forward": step["ms"] / forward_ms,
               "first_call_s": step["first_call_s"], "rel_err": relative_error(out, ctx.cfg_reference()),
               "negative_tokens": inputs.negative.shape[1], **probe.figures()}
    if mode.kind == "fast":
        ff, prepared = ctx.fast()[0], ctx.prepared(module)
        both = hm.fast_forward(ff, prepared, inputs, batch=2, attention=mode.attention).float()
        figures["kernels"] = prepared.last_plan.summary()
        pos = hm.fast_forward(ff, prepared, inputs, attention=mode.attention).float()
        neg = hm.fast_forward(ff, prepared, inputs, attention=mode.attention, negative=True).float()
        figures["batch2_vs_batch1_rel_err"] = max(relative_error(both[:1], pos), relative_error(both[1:], neg))
    return figures


def measure_resolution(ctx: ForwardContext, module, mode: Mode, hw: tuple[int, int], weights_gib: float
                       ) -> dict[str, Any]:
    return measure_forward(ctx, module, mode, weights_gib, hw)


# ----------------------------------------------------------------------------- compile switches


def fast_compiled(ctx: ForwardContext, cuda_graphs: bool = False):
    """Enter: the pack's regional compile (``qwen_edit.compile.set_regional_compile``, which compiles the fast
    forward's block function) with the run's ``CompileChoice`` (``cuda_graphs``: plus the pack's whole-forward
    CUDA graphs), under the pack's dynamo settings."""
    from qwen_edit_hopper.qwen_edit.compile import dynamo_settings, set_regional_compile
    from qwen_edit_hopper.qwen_edit.memory import Resident

    @contextlib.contextmanager
    def enter(module):
        resident = Resident(key=("bench",), module=module, nbytes=0, label="bench", prepared=ctx.prepared(module))
        with dynamo_settings():
            choice = ctx.compile_choice
            if cuda_graphs and choice is not None:
                choice = dataclasses.replace(choice, cuda_graphs=True)
            set_regional_compile(resident, choice)
            try:
                yield
            finally:
                set_regional_compile(resident, None)

    return enter


def anchor_compiled(dynamic: bool | None = False):
    """Enter: the anchors' compile for DiffSynth's forward, ComfyUI and torchao: ``block.compile()`` per block
    (``torch.compile(block._call_impl, dynamic=False)``), under the pack's dynamo settings."""
    from qwen_edit_hopper.qwen_edit.compile import dynamo_settings

    @contextlib.contextmanager
    def enter(module):
        blocks = list(module.transformer_blocks)
        with dynamo_settings():
            hm.regional_compile(blocks, dynamic)
            try:
                yield
            finally:
                hm.regional_uncompile(blocks)

    return enter


# ----------------------------------------------------------------------------- builders


def _fp8(backend: str, recipe: str | None = None, preset=None):
    from qwen_edit_hopper.fp8 import Fp8Config, TeRecipeConfig

    kwargs: dict[str, Any] = {"backend": backend}
    if recipe is not None:
        kwargs["te_recipe"] = TeRecipeConfig(name=recipe)
    if preset is not None:
        kwargs["preset"] = preset
    return Fp8Config(**kwargs)


FASTEST_PRESET = "attn+mlp+mod compute"
"""The pack's fastest preset (measured on an H200, bench/profile_forward.py): modulation linears in fp8
compute too (faster and, measured, more accurate than fp8 storage), with cuBLASLt fast accumulation."""


FASTEST_GEMM_KERNEL = "cublaslt"
"""The fastest preset's GEMM call: the pack's workspace-free cuBLASLt call, the same kernel as
``torch._scaled_mm`` without the memset before each large GEMM (bench/forward_ab_bench.py --gemm)."""


FASTEST_ATTENTION = "cudnn_fp8"
"""The fastest preset's attention: cuDNN's FP8 kernel with the block-fused quantization (the shipped
"fastest" workflow's choice); ``fastest-sdpa-compiled`` is the same model with bf16 SDPA, for the A/B."""


FASTEST_CUDA_GRAPHS = True
"""Whether the fastest preset runs as whole-forward CUDA graphs (``qwen_edit.fast.graphs``). On, as the shipped
"fastest" workflow: the Lightning 4-step edit took 0.90 s with and without them (H200);
``fastest-nographs-compiled`` measures the preset without them."""


def fastest_fp8():
    from qwen_edit_hopper.fp8 import Fp8Config

    return Fp8Config(backend="scaled_mm_rowwise", preset=FASTEST_PRESET, fast_accum=True,
                     gemm_kernel=FASTEST_GEMM_KERNEL)


def build_fastest(ctx: ForwardContext) -> torch.nn.Module:
    from qwen_edit_hopper.qwen_edit.fp8_dit import build_fp8_dit

    return build_fp8_dit(ctx.get_base(), fastest_fp8())


def build_pack_fp8(backend: str, recipe: str | None = None):
    def build(ctx: ForwardContext) -> torch.nn.Module:
        from qwen_edit_hopper.qwen_edit.fp8_dit import build_fp8_dit

        module = build_fp8_dit(ctx.get_base(), _fp8(backend, recipe))
        if recipe == "delayed":
            from qwen_edit_hopper.fp8 import calibrate_delayed_scaling

            inputs = ctx.inputs()
            report = calibrate_delayed_scaling(module, [
                lambda: hm.diffsynth_forward(module, inputs.with_timestep(900.0), grad=True),
                lambda: hm.diffsynth_forward(module, inputs.with_timestep(500.0), grad=True),
            ])
            module.bench_note = report.to_text()
        return module

    return build


def qkv_preset():
    """The default preset if it already puts the fused Q/K/V layers in fp8 compute, else it plus them."""
    from qwen_edit_hopper.fp8 import LayerPreset, get_preset
    from qwen_edit_hopper.fp8.presets import DEFAULT_PRESET, ROLE_COMPUTE

    base = get_preset(DEFAULT_PRESET)
    fused = ("transformer_blocks.0.attn.to_qkv", "transformer_blocks.0.attn.add_qkv_proj")
    if all(base.classify(name)[0] == ROLE_COMPUTE for name in fused):
        return base
    ff_pattern = importlib.import_module("qwen_edit_hopper.qwen_edit.fast_forward").FUSED_QKV_PATTERN
    return LayerPreset(name=f"{base.name}+fused-qkv", description=base.description + "; fused Q/K/V in fp8",
                       compute=(*base.compute, ff_pattern), storage=base.storage, keep=base.keep)


def build_fast_qkv_fp8(ctx: ForwardContext) -> torch.nn.Module:
    """A structural copy of the base with fused Q/K/V (new bf16 tensors), then fp8 row-wise (pack preset + QKV)."""
    from qwen_edit_hopper.fp8 import quantize_linears

    ff = ctx.fast()[0]
    module = hm.structure_copy(ctx.get_base())
    ff.fuse_qkv(module)
    report = quantize_linears(module, _fp8("scaled_mm_rowwise", preset=qkv_preset()))
    module.bench_note = report.summary()
    return module


def build_comfy(fp8: bool):
    def build(ctx: ForwardContext) -> torch.nn.Module:
        comfy = hm.import_comfy(ctx.device)
        ops = comfy.ops.fp8_ops if fp8 else comfy.ops.disable_weight_init
        model = hm.build_comfy_model(ctx.get_base(), comfy, ops, dtype=ctx.dtype)
        notes = [f"ComfyUI {comfy.folder}: attention {comfy.attention.optimized_attention.__name__}"]
        if ctx.device.type == "cuda":
            notes.append(f"supports_fp8_compute {comfy.mm.supports_fp8_compute(ctx.device)}")
        if fp8:
            notes.append(f"{hm.to_comfy_fp8(model, comfy)} block linears cast to float8_e4m3fn (no scale)")
        model.bench_note = "; ".join(notes)
        return model

    return build


def build_torchao(ctx: ForwardContext) -> torch.nn.Module:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    module = hm.structure_copy(ctx.get_base())
    quantize_(module.transformer_blocks, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    module.bench_note = "torchao float8 dynamic activation + weight, PerRow, all block linears"
    return module


def families(ctx: ForwardContext) -> dict[str, list[Group]]:
    """The groups of every family, in run order (within a family: most important first, so a run that meets
    its time budget drops the least important)."""
    fast_c, anchor_c = fast_compiled(ctx), anchor_compiled(False)
    fastest_c = fast_compiled(ctx, cuda_graphs=FASTEST_CUDA_GRAPHS)
    other_c = fast_compiled(ctx, cuda_graphs=not FASTEST_CUDA_GRAPHS)
    return {
        "ds": [
            Group("ds", "bf16", lambda c: c.get_base(), [
                Mode("bf16-eager", "ds", cfg=True),
                Mode("bf16-compiled", "ds", compiled=True, cfg=True, enter=anchor_c),
            ], shares_base=True),
            Group("ds", "fp8-rowwise", build_pack_fp8("scaled_mm_rowwise"), [
                Mode("fp8-rowwise-eager", "ds"),
                Mode("fp8-rowwise-compiled", "ds", compiled=True, cfg=True, enter=anchor_c),
            ]),
            Group("ds", "weight-only", build_pack_fp8("weight_only"), [Mode("weight-only-eager", "ds")]),
            Group("ds", "te-current", build_pack_fp8("te", "current"), [Mode("te-current-eager", "ds")]),
            Group("ds", "te-block", build_pack_fp8("te", "block"), [Mode("te-block-eager", "ds")]),
            Group("ds", "te-delayed", build_pack_fp8("te", "delayed"), [Mode("te-delayed-eager", "ds")]),
        ],
        "fast": [
            Group("fast", "bf16", lambda c: c.get_base(), [
                Mode("bf16-eager", "fast", cfg=True),
                Mode("bf16-compiled", "fast", compiled=True, cfg=True, resolution=True, enter=fast_c),
            ], shares_base=True),
            Group("fast", "fastest", build_fastest, [
                Mode("fastest-compiled", "fast", compiled=True, cfg=True, resolution=True, attention=FASTEST_ATTENTION,
                     enter=fastest_c),
                Mode("fastest-nographs-compiled" if FASTEST_CUDA_GRAPHS else "fastest-graphs-compiled", "fast",
                     compiled=True, cfg=True, attention=FASTEST_ATTENTION, enter=other_c),
                Mode("fastest-sdpa-compiled", "fast", compiled=True, cfg=True, enter=fast_c)]),
            Group("fast", "fp8-rowwise", build_pack_fp8("scaled_mm_rowwise"), [
                Mode("fp8-rowwise-eager", "fast"),
                Mode("fp8-rowwise-compiled", "fast", compiled=True, cfg=True, resolution=True, enter=fast_c)]),
            Group("fast", "fp8-rowwise-qkv", build_fast_qkv_fp8, [
                Mode("fp8-rowwise-qkv-compiled", "fast", compiled=True, cfg=True, resolution=True, enter=fast_c),
                Mode("fp8-rowwise-qkv-triton-compiled", "fast", compiled=True, attention="triton_fp8",
                     resolution=True, enter=fast_c),
            ]),
            Group("fast", "fp8-tensorwise", build_pack_fp8("scaled_mm_tensorwise"), [
                Mode("fp8-tensorwise-compiled", "fast", compiled=True, enter=fast_c)]),
            Group("fast", "te-current", build_pack_fp8("te", "current"), [
                Mode("te-current-compiled", "fast", compiled=True, enter=fast_c)]),
            Group("fast", "weight-only", build_pack_fp8("weight_only"), [Mode("weight-only-eager", "fast")]),
        ],
        "comfy": [
            Group("comfy", "bf16", build_comfy(False), [
                Mode("bf16-eager", "comfy", reference="B"),
                Mode("bf16-compiled", "comfy", compiled=True, reference="B", enter=anchor_c),
            ]),
            Group("comfy", "fp8-e4m3fn-fast", build_comfy(True), [
                Mode("fp8-e4m3fn-fast-eager", "comfy", reference="B"),
                Mode("fp8-e4m3fn-fast-compiled", "comfy", compiled=True, reference="B", enter=anchor_c),
            ]),
        ],
        "torchao": [
            Group("torchao", "fp8-rowwise", build_torchao, [
                Mode("fp8-rowwise-eager", "ds"),
                Mode("fp8-rowwise-compiled", "ds", compiled=True, enter=anchor_c),
            ]),
        ],
    }


def all_measurement_ids(ctx: ForwardContext) -> list[str]:
    ids = []
    for groups in families(ctx).values():
        for group in groups:
            for mode in group.modes:
                ids += measurement_ids(group, mode, ctx.sizes)
    return [*ids, REPEAT_ID]


REPEAT_ID = "forward/ds/bf16-eager-repeat"
COMPARED = {
    "forward": "ms: CUDA-event median per DiT forward (batch 1); rel_err: ||out - ref|| / ||ref|| against {ref}",
    "cfg": "step_ms: one true-CFG step (cfg 4); forward_ms: one batch-1 forward of the same path; rel_err against "
           "the DiffSynth bf16 eager CFG step",
    "resolution": "ms per forward at this size; rel_err against DiffSynth bf16 eager at the same size",
}


# ----------------------------------------------------------------------------- running


def run_group(ctx: ForwardContext, group: Group) -> None:
    runner = ctx.runner
    per_mode = [(mode, measurement_ids(group, mode, ctx.sizes)) for mode in group.modes]
    wanted = [(mode, ids) for mode, ids in per_mode if any(runner.wants(i) for i in ids)]
    if not wanted:
        return
    if ctx.no_compile:
        for mode, ids in wanted:
            if mode.compiled:
                for i in ids:
                    if runner.wants(i):
                        runner.skip(i, NOT_RUN, "--no-compile")
        wanted = [(mode, ids) for mode, ids in wanted if not mode.compiled]
        if not wanted:
            return
    if group.family == "fast" and ctx.fast()[0] is None:
        for _, ids in wanted:
            for i in ids:
                if runner.wants(i):
                    runner.skip(i, UNAVAILABLE, ctx.fast()[1])
        return
    all_ids = [i for _, ids in wanted for i in ids]
    compiled_any = False
    module = None
    with guarded(runner, all_ids, f"building {group.family}/{group.name}"):
        log(f"building {group.family}/{group.name}")
        if group.family == "comfy":
            _comfy_reference(ctx)
        module = group.build(ctx)
        weights = tensor_gib(module)
        note = getattr(module, "bench_note", "")
        for mode, ids in wanted:
            compiled_any |= mode.compiled
            _run_mode(ctx, group, mode, ids, module, weights, note)
    del module
    if compiled_any:
        torch._dynamo.reset()
    free_memory()


def _comfy_reference(ctx: ForwardContext) -> None:
    """Reference B: ComfyUI's model in bf16 eager on the base's tensors (built for it: shares the base, no copy)."""
    hw = ctx.sizes.forward
    if ctx.get_ref(("B", hw)) is None:
        model = build_comfy(False)(ctx)
        ctx.set_ref(("B", hw), hm.comfy_forward(model, ctx.inputs(hw)).float())
        del model


def _run_mode(ctx: ForwardContext, group: Group, mode: Mode, ids: list[str], module, weights: float, note: str
              ) -> None:
    runner = ctx.runner
    v = vid(group, mode)
    ref_text = _reference_text(mode)
    compile_cost = ctx.compile_estimate_s if mode.compiled else 0.0
    notes = [n for n in (note, _compile_note(ctx, group, mode)) if n]
    with guarded(runner, ids, f"switching on {v}"):
        enter = mode.enter(module) if mode.enter is not None else contextlib.nullcontext()
        with enter:
            first = True

            def cost(base_s: float) -> float:
                return base_s + (compile_cost if first else 0.0)

            rec = runner.run(f"forward/{v}", lambda: _forward_figures(ctx, module, mode, weights),
                             estimate_s=cost(20), compared_with=COMPARED["forward"].format(ref=ref_text), notes=notes)
            first = first and not (rec is not None and rec.status == OK)
            if mode.cfg:
                # a new graph: batch 2 (fast), or the negative prompt's length (DiffSynth, static shapes)
                estimate = cost(30) + (ctx.compile_estimate_s if mode.compiled else 0.0)
                rec = runner.run(f"cfg/{v}", lambda: _cfg_figures(ctx, module, mode, v), estimate_s=estimate,
                                 compared_with=COMPARED["cfg"], notes=notes)
                first = first and not (rec is not None and rec.status == OK)
            if mode.resolution:
                for hw in ctx.sizes.resolutions:
                    rec = runner.run(f"resolution/{v}@{hw[0]}x{hw[1]}",
                                     lambda hw=hw: measure_resolution(ctx, module, mode, hw, weights),
                                     estimate_s=cost(25), compared_with=COMPARED["resolution"], notes=notes)
                    first = first and not (rec is not None and rec.status == OK)


def _reference_text(mode: Mode) -> str:
    return ("reference B (ComfyUI core bf16 eager)" if mode.reference == "B"
            else "reference A (DiffSynth bf16 eager)")


def _compile_note(ctx: ForwardContext, group: Group, mode: Mode) -> str:
    if not mode.compiled:
        return ""
    if mode.kind == "fast":
        return f"the pack's regional compile of the fast block function, {ctx.compile_choice}"
    return "anchors' compile: torch.compile(block._call_impl, dynamic=False) per block"


def _forward_figures(ctx: ForwardContext, module, mode: Mode, weights: float) -> dict[str, Any]:
    figures = measure_forward(ctx, module, mode, weights)
    if mode.reference == "B":
        ref_a = ctx.reference()
        out = hm.comfy_forward(module, ctx.inputs()).float()
        figures["rel_err_vs_reference_A"] = relative_error(out, ref_a)
    return figures


def _cfg_figures(ctx: ForwardContext, module, mode: Mode, vid_: str) -> dict[str, Any]:
    forward_id = f"forward/{vid_}"
    fresh = forward_id in ctx.runner.recorded and ctx.runner.store.has_ok(forward_id)
    figures = measure_cfg(ctx, module, mode, ctx.runner.store.figure(forward_id, "ms") if fresh else None)
    if mode.kind == "fast":
        precision = "bf16" if mode.name.startswith("bf16") else "fp8-rowwise"
        seq = ctx.runner.store.figure(f"cfg/ds/{precision}-{'compiled' if mode.compiled else 'eager'}", "step_ms")
        if seq:
            figures["speedup_vs_diffsynth_sequential"] = seq / figures["step_ms"]
    return figures


def run_repeat(ctx: ForwardContext) -> None:
    """Time DiffSynth bf16 eager again at the end: the spread between the two is this run's noise."""
    runner = ctx.runner
    if not runner.wants(REPEAT_ID) or ctx.base is None:
        return
    first = runner.store.figure("forward/ds/bf16-eager", "ms")
    mode = Mode("bf16-eager", "ds")

    def figures() -> dict[str, Any]:
        with ctx._base_eager() as base:
            out = measure_forward(ctx, base, mode, tensor_gib(base))
        if first:
            out["spread_vs_first"] = out["ms"] / first - 1.0
        return out

    runner.run(REPEAT_ID, figures, estimate_s=20,
               compared_with="the same path timed again at the end of the run (noise of this run)")


def run_families(ctx: ForwardContext, names: tuple[str, ...] = FAMILIES) -> None:
    groups = families(ctx)
    for name in names:
        for group in groups[name]:
            run_group(ctx, group)
        torch._dynamo.reset()
    run_repeat(ctx)
