"""Which fused kernels the fast forward runs: decided in one place, every kernel left out said with its reason.

:func:`select_kernels` takes the model, the :class:`~.options.ForwardOptions`, the device, the attention backend
and the forward's shape, and returns a :class:`KernelPlan`: the :class:`~.block_kernels.BlockKernels` the block
function reads, the forward-level choices (shared modulation, trimmed last block) and one
:class:`KernelChoice` per kernel with the reason it runs or does not ("left out joint_v_gemm: attention backend
sdpa; it writes cuDNN FP8 attention's v"). :class:`.prepared.PreparedDit` keeps one plan per signature (options,
backend, shape, device), so the decision is made once; each new plan is logged with what it left out.

Conditions come in three kinds, checked in this order for each kernel:

1. the options allow it;
2. the device, dtype, attention backend and shape allow it (a Hopper GPU, Triton, bf16 activations, whole
   128-row tiles, ...); these decide the ``BlockKernels`` fields;
3. the model's layers are the kind the kernel is written for (row-wise fp8 GEMM layers, fast accumulation, the
   cuBLASLt call, ...). The block function checks those per layer; here they are counted per block, so the report
   says in how many blocks a kernel runs.

Report format (:meth:`KernelPlan.describe`)::

    kernels for batch 1, 8192 image tokens (4096 target) + 300 text tokens, bfloat16 on cuda:0 (compute
    capability 9.0), attention cudnn_fp8, options shipped:
      used: norm_quant (60 of 60 blocks), gelu_gemm:image (60 of 60 blocks), ...
      left out: gelu_quant: the fused GELU GEMM computes every MLP's hidden state; ...

and :meth:`KernelPlan.summary` gives the same in one line for a node's text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...fp8.capability import Capability, cuda_capability, resolve_device, triton_capability
from ...fp8.gelu_quant import gelu_quant_capability
from ...fp8.linear import ScaledMMLinear
from ...fp8.norm_quant import norm_quant_capability
from ...fp8.small_m_gemm import config_for_shape
from ..kernels.joint_v_gemm import MIN_IMAGE_ROWS
from ..kernels.qk_norm_rope_quant import qk_norm_rope_quant_capability
from .block import head_shape, qkv_layers
from .block_kernels import BlockKernels
from .fp8_attention import joint_v_layers
from .mlp import gelu_gemm_layer, mlp_takes_prequantized, uses_fused_gelu_quant
from .modulation import MAX_ROWS, modulation_capability
from .options import RESIDUAL_SITES, STREAMS, ForwardOptions
from .prequant import takes_prequantized
from .residual_gemm import epilogue_layer, one_gate_row

__all__ = ["DeviceFacts", "ForwardShape", "KernelChoice", "KernelPlan", "select_kernels"]

logger = logging.getLogger(__name__)

HOPPER = (9, 0)
JOINT_V_TILE_ROWS = 128
"""Rows of the joint v GEMM's tiles (``fp8.gelu_gemm.CONFIG``): a tile never spans two samples."""


@dataclass(frozen=True)
class ForwardShape:
    """What the kernel choice depends on in one forward's inputs.

    Attributes:
        batch: samples B (2 for batched true CFG).
        image_tokens: image tokens per sample (target, then reference images).
        target_tokens: the target image's tokens (what the forward returns).
        text_tokens: text tokens per sample (the padded length L).
        timestep_rows: rows of the timestep (1, or B for per-sample timesteps).
        zero_cond_t: Qwen-Image-Edit-2511's reference tokens at timestep 0 (per-token image modulation).
        text_mask: ``text_padding="mask"`` (one SDPA call with a key mask).
        dtype: the activations' dtype (the model's compute dtype).
    """

    batch: int
    image_tokens: int
    target_tokens: int
    text_tokens: int
    timestep_rows: int
    zero_cond_t: bool
    text_mask: bool
    dtype: torch.dtype

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        extra = ", zero_cond_t" if self.zero_cond_t else ""
        return (f"batch {self.batch}, {self.image_tokens} image tokens ({self.target_tokens} target) + "
                f"{self.text_tokens} text tokens, {dtype}{extra}")


@dataclass(frozen=True)
class DeviceFacts:
    """The device as the kernel choice sees it: where tensors live and, for CUDA, the compute capability."""

    device: torch.device
    capability: tuple[int, int] | None

    @classmethod
    def of(cls, device: torch.device | str) -> DeviceFacts:
        dev = resolve_device(device)
        return cls(dev, cuda_capability(dev) if dev.type == "cuda" else None)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        if self.capability is None:
            return str(self.device)
        return f"{self.device} (compute capability {self.capability[0]}.{self.capability[1]})"


@dataclass(frozen=True)
class KernelChoice:
    """One kernel of the forward: whether it runs (``used``) and why, or why not."""

    name: str
    used: bool
    reason: str

    def describe(self) -> str:
        return f"{self.name} ({self.reason})" if self.used else f"{self.name}: {self.reason}"


@dataclass(frozen=True)
class KernelPlan:
    """The kernels one forward signature runs (see the module docstring for the report format).

    Attributes:
        options, backend, device, shape: what it was decided for.
        block: what each block call may run (passed to the block function).
        shared_modulation: all modulation linears in two launches before the first block.
        trim_last_block: the last block computes only the target tokens after its attention.
        choices: every kernel, used or left out, with its reason.
    """

    options: ForwardOptions
    backend: str
    device: str
    shape: ForwardShape
    block: BlockKernels
    shared_modulation: bool
    trim_last_block: bool
    choices: tuple[KernelChoice, ...]

    @property
    def used(self) -> tuple[str, ...]:
        """Names of the kernels that run."""
        return tuple(c.name for c in self.choices if c.used)

    @property
    def left_out(self) -> tuple[KernelChoice, ...]:
        """The kernels that do not run, with their reasons."""
        return tuple(c for c in self.choices if not c.used)

    def describe(self) -> str:
        """A heading and two lines: the kernels used (where) and the ones left out (why)."""
        used = ", ".join(c.describe() for c in self.choices if c.used) or "none"
        left = "; ".join(c.describe() for c in self.left_out) or "none"
        return (f"kernels for {self.shape.describe()} on {self.device}, attention {self.backend}, options "
                f"{self.options.describe()}:\n  used: {used}\n  left out: {left}")

    def summary(self) -> str:
        """One line: ``kernels: a, b; left out: c (why); d (why)``."""
        left = "; ".join(f"{c.name} ({c.reason})" for c in self.left_out)
        return f"kernels: {', '.join(self.used) or 'none'}" + (f"; left out: {left}" if left else "")


# ------------------------------------------------------------------------------------------------- conditions


def _reason_against(*checks: Callable[[], Capability | str | None]) -> str | None:
    """The reason against the first check that fails (a check returns a Capability, or a reason / None), else None."""
    for check in checks:
        result = check()
        if isinstance(result, Capability):
            if not result.ok:
                return result.reason
        elif result:
            return result
    return None


def _option(on: bool, field: str) -> Callable[[], str | None]:
    return lambda: None if on else f"off in the options ({field})"


def _cuda(facts: DeviceFacts) -> Callable[[], str | None]:
    return lambda: None if facts.cuda else f"the model runs on {facts.device.type}; the kernel needs a CUDA GPU"


def _hopper(facts: DeviceFacts) -> Callable[[], str | None]:
    def check() -> str | None:
        if not facts.cuda:
            return f"the model runs on {facts.device.type}; the kernel is written for Hopper (compute capability 9.0)"
        if facts.capability != HOPPER:
            found = "unknown" if facts.capability is None else f"{facts.capability[0]}.{facts.capability[1]}"
            return f"the kernel is written for Hopper (compute capability 9.0), found {found}"
        return None

    return check


def _bf16(shape: ForwardShape) -> Callable[[], str | None]:
    return lambda: None if shape.dtype == torch.bfloat16 else f"activations are {shape.dtype}, the kernel takes bf16"


def _cudnn_fp8(backend: str, shape: ForwardShape) -> Callable[[], str | None]:
    def check() -> str | None:
        if backend != "cudnn_fp8":
            return f"attention backend {backend}; the kernel feeds cuDNN FP8 attention (cudnn_fp8)"
        if shape.text_mask:
            return "text_padding='mask' runs SDPA"
        return None

    return check


# ------------------------------------------------------------------------------------------------- model facts


@dataclass(frozen=True)
class _BlockFacts:
    """The layer kinds of one block that the kernels depend on."""

    img_fp8: bool
    txt_fp8: bool
    out_fp8: bool
    joint_v_layers: bool
    mlp_fused: dict[str, bool]
    mlp_prequantized: dict[str, bool]
    gelu_gemm_layer: dict[str, bool]
    epilogue: dict[tuple[str, str], bool]


def _block_facts(block: torch.nn.Module, gelu_quant: bool) -> _BlockFacts:
    attn = block.attn
    img_qkv, txt_qkv = qkv_layers(attn, True), qkv_layers(attn, False)
    mlps = {"image": block.img_mlp, "text": block.txt_mlp}
    allowed = BlockKernels(gelu_quant=gelu_quant)
    return _BlockFacts(
        img_fp8=all(takes_prequantized(p) for p in img_qkv),
        txt_fp8=all(takes_prequantized(p) for p in txt_qkv),
        out_fp8=takes_prequantized(attn.to_out[0]) and takes_prequantized(attn.to_add_out),
        joint_v_layers=joint_v_layers(img_qkv, txt_qkv) is not None,
        mlp_fused={s: uses_fused_gelu_quant(m, allowed) for s, m in mlps.items()},
        mlp_prequantized={s: mlp_takes_prequantized(m, allowed) for s, m in mlps.items()},
        gelu_gemm_layer={s: mlp_takes_prequantized(m, allowed) and gelu_gemm_layer(m.net[0].proj)
                         for s, m in mlps.items()},
        epilogue={("image", "attention"): epilogue_layer(attn.to_out[0]),
                  ("text", "attention"): epilogue_layer(attn.to_add_out),
                  ("image", "mlp"): epilogue_layer(block.img_mlp.net[2]),
                  ("text", "mlp"): epilogue_layer(block.txt_mlp.net[2])},
    )


def _count(blocks: list[_BlockFacts], predicate: Callable[[_BlockFacts], bool]) -> int:
    return sum(1 for b in blocks if predicate(b))


class _Report:
    """Collects :class:`KernelChoice` values; a kernel used in some blocks only says in how many."""

    def __init__(self, blocks: int):
        self.blocks = blocks
        self.choices: list[KernelChoice] = []

    def gate(self, name: str, problem: str | None) -> bool:
        if problem is not None:
            self.choices.append(KernelChoice(name, False, problem))
        return problem is None

    def blocks_using(self, name: str, count: int, none_reason: str) -> bool:
        if count == 0:
            self.choices.append(KernelChoice(name, False, none_reason))
            return False
        self.choices.append(KernelChoice(name, True, f"{count} of {self.blocks} blocks"))
        return True

    def used(self, name: str, reason: str) -> None:
        self.choices.append(KernelChoice(name, True, reason))

    def left_out(self, name: str, reason: str) -> None:
        self.choices.append(KernelChoice(name, False, reason))


# ------------------------------------------------------------------------------------------------- the choice


def select_kernels(dit: torch.nn.Module, options: ForwardOptions, device: torch.device | str | DeviceFacts,
                   backend: str, shape: ForwardShape) -> KernelPlan:
    """Decide which fused kernels the fast forward runs for this model, options, device, backend and shape.

    Args:
        dit: a DiffSynth ``QwenImageDiT`` (after fp8 conversion and Q/K/V fusion, if any).
        options: what the forward may use.
        device: where the forward runs (or :class:`DeviceFacts`, e.g. to ask what a Hopper GPU would run).
        backend: the attention backend name (``fp8.attention.BACKENDS``).
        shape: the forward's :class:`ForwardShape`.

    Returns:
        A :class:`KernelPlan` with a :class:`KernelChoice` for every kernel. Nothing runs; no tensor is read.
    """
    facts = device if isinstance(device, DeviceFacts) else DeviceFacts.of(device)
    blocks_list = list(dit.transformer_blocks)
    report = _Report(len(blocks_list))
    dim = dit.transformer_blocks[0].attn.to_out[0].out_features if blocks_list else 0
    head_dim = head_shape(blocks_list[0].attn)[1] if blocks_list else 0
    hidden = max((b.img_mlp.net[2].in_features for b in blocks_list), default=0)
    triton = triton_capability()

    # forward level
    trim = options.trim_last_block
    if trim:
        report.used("trim_last_block", "the last block computes the target image tokens only after its attention")
    else:
        report.left_out("trim_last_block", "off in the options (trim_last_block)")

    modulation = report.gate("shared_modulation", _reason_against(
        _option(options.shared_modulation, "shared_modulation"), _bf16(shape),
        lambda: None if shape.timestep_rows * (2 if shape.zero_cond_t else 1) <= MAX_ROWS
        else f"{shape.timestep_rows * (2 if shape.zero_cond_t else 1)} timestep rows, the launch takes {MAX_ROWS}",
        lambda: modulation_capability(dit)))
    if modulation:
        report.used("shared_modulation", f"{2 * len(blocks_list)} modulation linears in two launches")

    # block level: norm + quantize
    norm_quant = report.gate("norm_quant", _reason_against(
        _option(options.fused_norm_quant, "fused_norm_quant"), _cuda(facts), lambda: triton, _bf16(shape),
        lambda: norm_quant_capability(facts.device, dim)))
    gelu_quant_gate = _reason_against(
        _option(options.fused_gelu_quant, "fused_gelu_quant"), _cuda(facts), lambda: triton, _bf16(shape),
        lambda: gelu_quant_capability(facts.device, hidden))
    gelu_quant = gelu_quant_gate is None
    block_facts = [_block_facts(b, gelu_quant) for b in blocks_list]
    if norm_quant:
        norm_quant = report.blocks_using("norm_quant", _count(block_facts, lambda b: b.img_fp8 or b.txt_fp8 or any(
            b.mlp_prequantized.values())), "no block's Q/K/V or MLP up-projection is a row-wise fp8 GEMM layer")

    # the MLP: GELU GEMM per stream, else GELU + quantize
    gelu_gemm: list[str] = []
    for stream in STREAMS:
        name = f"gelu_gemm:{stream}"
        problem = _reason_against(
            lambda stream=stream: None if stream in options.gelu_gemm else "off in the options (gelu_gemm)",
            _hopper(facts), lambda: triton, lambda: gelu_quant_gate,
            lambda: None if norm_quant else "it needs the LayerNorm kernel's row norms (norm_quant is left out)")
        if report.gate(name, problem) and report.blocks_using(
                name, _count(block_facts, lambda b, s=stream: b.gelu_gemm_layer[s]),
                "no up-projection is a fast-accumulation row-wise fp8 layer with a column bound on the GPU"):
            gelu_gemm.append(stream)
    if report.gate("gelu_quant", gelu_quant_gate):
        count = _count(block_facts, lambda b: any(b.mlp_fused[s] and s not in gelu_gemm for s in STREAMS))
        none = ("the fused GELU GEMM computes every MLP's hidden state" if gelu_gemm
                else "no MLP with the kernels' GELU (y * sigmoid(1.702 y)) has a row-wise fp8 down-projection")
        report.blocks_using("gelu_quant", count, none)

    # attention: cuDNN FP8's q / k / v
    attention_gate = _cudnn_fp8(backend, shape)
    qk_quant = report.gate("qk_norm_rope_quant", _reason_against(
        _option(options.fused_qk_quant, "fused_qk_quant"), attention_gate, _cuda(facts), lambda: triton,
        _bf16(shape), lambda: qk_norm_rope_quant_capability(facts.device, head_dim)))
    if qk_quant:
        report.used("qk_norm_rope_quant", f"{len(blocks_list)} of {len(blocks_list)} blocks")
    joint_v_gate = _reason_against(
        _option(options.joint_v_gemm, "joint_v_gemm"), attention_gate, _hopper(facts), lambda: triton,
        lambda: None if shape.image_tokens % JOINT_V_TILE_ROWS == 0
        else f"{shape.image_tokens} image tokens per sample: not whole {JOINT_V_TILE_ROWS}-row tiles",
        lambda: None if shape.batch * shape.image_tokens >= MIN_IMAGE_ROWS
        else f"{shape.batch * shape.image_tokens} image rows, fewer than {MIN_IMAGE_ROWS}",
        lambda: None if norm_quant else "it needs the LayerNorm kernel's row norms (norm_quant is left out)")
    joint_v = report.gate("joint_v_gemm", joint_v_gate)
    joint_v_blocks = _count(block_facts, lambda b: b.joint_v_layers and b.img_fp8 and b.txt_fp8) if joint_v else 0
    if joint_v:
        joint_v = report.blocks_using("joint_v_gemm", joint_v_blocks, "no block's v projections are fast-accumulation "
                                      "row-wise fp8 layers with a column bound (three image projections)")
    v_quant = report.gate("joint_v_quant", _reason_against(
        _option(options.fused_v_quant, "fused_v_quant"), attention_gate, _cuda(facts), lambda: triton, _bf16(shape),
        lambda: qk_norm_rope_quant_capability(facts.device, head_dim)))
    if v_quant:
        report.blocks_using("joint_v_quant", len(blocks_list) - joint_v_blocks, "the joint v GEMM writes v")

    # residual updates in the GEMM epilogue
    sites: list[str] = []
    fp8_attention_output = backend in ("cudnn_fp8", "cudnn_fp8_emulated") and not shape.text_mask
    for site in RESIDUAL_SITES:
        name = f"residual_epilogue:{site}"
        problem = _reason_against(
            lambda site=site: None if site in options.residual_epilogue else "off in the options (residual_epilogue)",
            _cuda(facts),
            (lambda: None if fp8_attention_output else f"attention backend {backend} hands the output projections "
             "bf16, not e4m3") if site == "attention" else
            (lambda: None if gelu_quant else "the MLP's fused path is left out (gelu_quant)"))
        if not report.gate(name, problem):
            continue
        sites.append(site)

        def runs(b: _BlockFacts, site: str = site) -> bool:
            return any(b.epilogue[(stream, site)] and one_gate_row(shape.timestep_rows,
                                                                   stream == "image" and shape.zero_cond_t)
                       and (b.out_fp8 if site == "attention" else b.mlp_fused[stream]) for stream in STREAMS)

        report.blocks_using(name, _count(block_facts, runs),
                            "no layer on the cuBLASLt call (gemm_kernel='cublaslt') with a row-wise fp8 input and "
                            "one gate row for every token")

    # few-row GEMMs
    small_m = report.gate("small_m_gemm", _reason_against(
        _option(options.small_m_gemm, "small_m_gemm"), _hopper(facts), lambda: triton))
    if small_m:
        rows = shape.batch * shape.text_tokens
        tuned = sorted({(layer.in_features, layer.out_features) for b in blocks_list
                        for layer in _text_layers(b, "text" in gelu_gemm)
                        if isinstance(layer, ScaledMMLinear) and layer.granularity == "rowwise" and not layer.emulate
                        and layer.fast_accum
                        and config_for_shape(rows, layer.in_features, layer.out_features, HOPPER) is not None})
        if tuned:
            report.used("small_m_gemm", f"text GEMMs {', '.join(f'{k}->{n}' for k, n in tuned)} at {rows} rows")
        else:
            report.left_out("small_m_gemm", f"no row-wise fp8 text GEMM of {rows} rows at a tuned shape (17 to 384 "
                                            "rows, fast accumulation)")

    block = BlockKernels(norm_quant=norm_quant, gelu_quant=gelu_quant, gelu_gemm=tuple(gelu_gemm), qk_quant=qk_quant,
                         v_quant=v_quant, joint_v_gemm=joint_v, residual_epilogue=tuple(sites), small_m_gemm=small_m)
    plan = KernelPlan(options, backend, facts.describe(), shape, block, modulation, trim,
                      tuple(sorted(report.choices, key=lambda c: _ORDER.index(c.name))))
    logger.info("fast forward %s", plan.describe())
    return plan


def _text_layers(block: torch.nn.Module, gelu_gemm: bool) -> tuple[torch.nn.Module, ...]:
    """The text stream's GEMM layers on the text rows (Q/K/V, output projection, MLP; the up-projection not where
    the fused GELU GEMM runs it)."""
    up = () if gelu_gemm else (block.txt_mlp.net[0].proj,)
    return (*qkv_layers(block.attn, False), block.attn.to_add_out, *up, block.txt_mlp.net[2])


_ORDER = ("trim_last_block", "shared_modulation", "norm_quant", "gelu_gemm:image", "gelu_gemm:text", "gelu_quant",
          "qk_norm_rope_quant", "joint_v_gemm", "joint_v_quant", "residual_epilogue:attention",
          "residual_epilogue:mlp", "small_m_gemm")
