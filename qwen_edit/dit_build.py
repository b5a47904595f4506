"""The DiT a plan asks for, built one group of weights at a time straight from its files.

A group is one transformer block, or everything outside the blocks. Each group is read from the
checkpoint onto the compute device (safetensors memory-maps the file: the host holds its pages, no
copy of the model), dequantized to the compute dtype, given the plan's LoRA chain (float32 sum, one
rounding) and, for an fp8 plan, quantized into the model's fp8 layers, before the next group is read.
So an fp8 DiT never exists in bf16 as a whole: the device holds the fp8 model built so far and one
block in bf16 (0.7 GB at full size). Each finished group is moved into one allocation of its own
(``device_pack``), so the build's temporaries leave no pages of the memory pool pinned.

A LoRA change re-reads the groups the old and the new chain touch from the file and writes the new
values into the same tensors (fp8 layers re-quantized in place), so compiled graphs and captured CUDA
graphs stay valid: they read the new values. No original weights are kept anywhere: the file is the
original.

The result is numerically the model the whole-file loader builds: the same dequantization, the same
LoRA fusion and the same quantization, applied per group.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoints.dit import DiTConfig, create_dit, infer_dit_config
from .checkpoints.layouts import ModelFiles, ValidatedFiles, read_json, validate_model_files
from .checkpoints.materialize import check_keys_and_shapes, find_meta_tensors, read_tensors
from .checkpoints.scaled_fp8 import dequantize, is_scale_key
from .checkpoints.shapes import strip_prefix, validated_dit_shapes
from .device_pack import pack_tensors

logger = logging.getLogger(__name__)

BLOCKS = "transformer_blocks"
_BLOCK_NAME = re.compile(r"^transformer_blocks\.(\d+)\.")
REST = ""
"""The group of every weight outside the transformer blocks (embeddings, norms, output)."""

LoraChain = Sequence[tuple[Any, float]]
"""``(ParsedLora, strength)`` pairs in the user's order (``qwen_edit.lora``)."""


def group_of(name: str) -> str:
    """The group a model tensor belongs to: ``"transformer_blocks.7."`` or :data:`REST`."""
    match = _BLOCK_NAME.match(name)
    return match.group(0) if match else REST


class DitSource:
    """The DiT checkpoint of a set of files, read group by group.

    Holds the validated headers and the DiT's configuration (read from the headers and the diffusers
    ``config.json``); reading a group opens the shards that hold it, never the whole file.
    """

    def __init__(self, files: ModelFiles, validated: ValidatedFiles | None = None):
        if validated is None or "dit" not in validated.headers or validated.files != files:
            validated = validate_model_files(files, parts=("dit",))
        self.files = files
        self.validated = validated
        self.path: Path = files.source("dit")
        self.prefix: str = validated.kinds["dit"].prefix
        self.shapes = validated_dit_shapes(validated)
        self.config: DiTConfig = infer_dit_config(self.shapes, source=self.path,
                                                  hf_config=read_json(files.config_json("dit")))

    def groups(self) -> list[str]:
        """Group names in load order: the blocks, then :data:`REST`."""
        return [f"{BLOCKS}.{index}." for index in range(self.config.num_layers)] + [REST]

    def model_name(self, stored: str) -> str:
        return strip_prefix(stored, self.prefix)

    def read(self, groups: Iterable[str], *, device: torch.device | str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Model name -> tensor for every tensor of ``groups``, on ``device``, floating tensors in ``dtype``.

        fp8 weights are dequantized with their scales (``W8.float() * scale``); scales and markers are dropped.

        Raises:
            CheckpointError: the file cannot be read, or its fp8 scales are broken (naming the file).
        """
        wanted = set(groups)

        def rename(stored: str) -> str | None:
            name = self.model_name(stored)
            if is_scale_key(name):
                owner = name.rpartition(".")[0] + "." if "." in name else REST
                return name if group_of(owner) in wanted else None
            return name if group_of(name) in wanted else None

        tensors, _ = read_tensors(self.validated.headers["dit"], device=device, rename=rename)
        return dequantize(tensors, dtype=dtype, source=self.path)


def _fused(tensors: dict[str, torch.Tensor], chain: LoraChain) -> dict[str, torch.Tensor]:
    """``tensors`` with the chain fused into the weights it touches (values of other names unchanged)."""
    if not chain:
        return tensors
    from .lora import fused_state

    names = set(tensors)
    restricted = [(_restricted(lora, names), strength) for lora, strength in chain]
    if not any(lora.patches for lora, _ in restricted):
        return tensors
    tensors.update(fused_state(tensors, restricted))
    return tensors


def _restricted(lora: Any, names: set[str]) -> Any:
    import dataclasses

    return dataclasses.replace(lora, patches=tuple(p for p in lora.patches if p.target in names))


def _expected(model: torch.nn.Module, group: str) -> dict[str, tuple[int, ...]]:
    """The group's tensor names and shapes in the model (a block's from the block alone: one walk per group, not
    one over the whole model)."""
    part = model if group == REST else model.get_submodule(group.rstrip("."))
    return {name: tuple(t.shape) for name, t in part.state_dict(prefix=group, keep_vars=True).items()
            if group_of(name) == group and not name.startswith("pos_embed.")}


def _assign(model: torch.nn.Module, group: str, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Check the group's keys and shapes strictly, then assign its tensors to the meta-built model."""
    check_keys_and_shapes(_expected(model, group), {k: tuple(v.shape) for k, v in tensors.items()},
                          source=source, what=f"the Qwen-Image DiT's {group.rstrip('.') or 'non-block weights'}")
    if group == REST:
        model.load_state_dict(tensors, strict=False, assign=True)
        return
    block = model.get_submodule(group.rstrip("."))
    block.load_state_dict({name[len(group):]: t for name, t in tensors.items()}, strict=True, assign=True)


@dataclass
class BuiltDit:
    """A DiT built by :func:`build_dit`: the module, its fp8 conversion report (None in bf16), seconds."""

    module: torch.nn.Module
    fp8_report: Any
    seconds: float


@torch.no_grad()
def build_dit(source: DitSource, *, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
              loras: LoraChain = (), fp8_config: Any = None, host_blocks: int = 0,
              check_interrupt: Callable[[], None] = lambda: None) -> BuiltDit:
    """Build the DiT group by group (see the module docstring).

    Args:
        source: the DiT checkpoint.
        device: where the weights go (the compute device).
        dtype: compute dtype of the weights that stay high precision (bf16; float32 on CPU).
        loras: the LoRA chain, fused before quantization.
        fp8_config: an ``fp8.Fp8Config``, or None for the plain model in ``dtype``.
        host_blocks: keep the last this many blocks in page-locked host memory (``model.layer_streaming``, a
            ``streaming.LayerStreaming`` without hooks; the fast forward copies each to the device when it
            runs). Each goes to host memory as soon as it is built, so the device never holds them all: the
            build peaks at the device-resident blocks plus one block. 0.32 GiB of GPU memory saved per block
            in fp8 (0.63 in bf16), about 13 ms per block and forward at PCIe 5 speed. CUDA devices only
            (ValueError elsewhere, or for a count outside 0..num_layers).
        check_interrupt: called between groups (raises to stop); what was built is then dropped.

    Returns:
        :class:`BuiltDit`; with fp8, the text stream's Q/K/V of each block are one fused row-wise layer where
        all three are row-wise (``fast.qkv.fuse_fp8_qkv``).

    Raises:
        CheckpointError: a group's keys or shapes do not match the DiT its headers describe.
        Fp8Error: the fp8 backend cannot run here (before any tensor is read).
    """
    started = time.perf_counter()
    if fp8_config is not None:
        from ..fp8 import require_backend

        require_backend(fp8_config, device)
    streaming = _host_streaming(source, device, host_blocks)
    first_host_block = source.config.num_layers - host_blocks
    model = create_dit(source.config)
    reports = []
    bytes_before = 0
    fused_qkv = 0
    for group in source.groups():
        check_interrupt()
        tensors = _fused(source.read([group], device=device, dtype=dtype), loras)
        bytes_before += sum(t.numel() * t.element_size() for t in tensors.values())
        _assign(model, group, tensors, source.path)
        del tensors
        if fp8_config is not None:
            reports.append(_quantize_group(model, group, fp8_config))
        if group == REST:
            pack_tensors(model, device, leave=model.transformer_blocks)
            continue
        index = int(group[len(BLOCKS) + 1:-1])
        block = model.transformer_blocks[index]
        if fp8_config is not None:
            from .fast.qkv import FP8_FUSED_STREAMS, fuse_block_fp8_qkv

            fused_qkv += fuse_block_fp8_qkv(block, index, FP8_FUSED_STREAMS)
        if streaming is not None and index >= first_host_block:
            streaming.add(block)
        else:
            pack_tensors(block, device)
    leftover = [name for name in find_meta_tensors(model) if not name.startswith("pos_embed")]
    if leftover:
        raise RuntimeError(f"{source.path.name}: the DiT still has meta tensors after loading: {leftover[:5]}")
    if streaming is not None:
        streaming.place_rest(model)
        model.layer_streaming = streaming
    else:
        model.to(device)
    model.requires_grad_(False)
    model.eval()
    report = None
    if fp8_config is not None:
        from ..fp8.swap import merge_reports, module_bytes

        report = merge_reports(reports, bytes_before, module_bytes(model))
        model.fused_qkv_layers = fused_qkv
        model.fp8_report = report
        logger.info("fp8 DiT built from %s: %s; %d fused Q/K/V layers", source.path.name, report.counts,
                    model.fused_qkv_layers)
    seconds = time.perf_counter() - started
    logger.info("DiT from %s built group by group in %.1f s", source.path.name, seconds)
    return BuiltDit(model, report, seconds)


def _host_streaming(source: DitSource, device: torch.device | str, host_blocks: int) -> Any:
    """The ``LayerStreaming`` that receives the last ``host_blocks`` blocks, or None for 0."""
    if not 0 <= host_blocks <= source.config.num_layers:
        raise ValueError(f"host_blocks must be between 0 and the model's {source.config.num_layers} blocks, got "
                         f"{host_blocks}")
    if not host_blocks:
        return None
    from .streaming import LayerStreaming

    return LayerStreaming(device, hooks=False)


def _quantize_group(model: torch.nn.Module, group: str, fp8_config: Any):
    from ..fp8 import quantize_linears

    if group == REST:
        return quantize_linears(model, fp8_config, scope=lambda name: group_of(name + ".") == REST)
    return quantize_linears(model.get_submodule(group.rstrip(".")), fp8_config, prefix=group)


@torch.no_grad()
def refresh_weights(model: torch.nn.Module, source: DitSource, names: Iterable[str], loras: LoraChain, *,
                    device: torch.device | str, dtype: torch.dtype) -> bool:
    """Give ``names`` (model tensor names) their values under ``loras``, read again from the file, in place.

    fp8 layers are re-quantized into their own tensors (a Q/K/V projection fused into one layer fills its
    rows). Returns False, changing nothing, when a touched layer cannot be updated in place (Transformer
    Engine keeps its weights in its own format): the caller rebuilds the model.
    """
    from .fp8_dit import can_write_in_place, write_weights

    by_group: dict[str, set[str]] = {}
    for name in names:
        by_group.setdefault(group_of(name), set()).add(name)
    if not by_group:
        return True
    if not can_write_in_place(model, set().union(*by_group.values())):
        return False
    for group, wanted in sorted(by_group.items()):
        tensors = _fused(source.read([group], device=device, dtype=dtype), loras)
        write_weights(model, {name: tensors[name] for name in wanted})
        del tensors
    logger.info("refreshed %d weights of the DiT from %s", sum(map(len, by_group.values())), source.path.name)
    return True


def lora_targets(chain: LoraChain) -> set[str]:
    """Every tensor name a chain changes (strength 0 changes nothing)."""
    return {target for lora, strength in chain if strength != 0 for target in lora.targets}


def estimate_bytes(source: DitSource, fp8_config: Any, dtype: torch.dtype = torch.bfloat16,
                   group: str | None = None) -> int:
    """Bytes the built DiT (or one ``group`` of it, e.g. ``"transformer_blocks.0."``) will hold, from its headers
    and the fp8 layer plan (no tensor read).

    fp8 layers count one byte a weight plus a float32 scale a row; everything else ``dtype``.
    """
    element = torch.empty((), dtype=dtype).element_size()
    fp8_layers: dict[str, int] = {}
    if fp8_config is not None:
        from ..fp8.swap import KEPT, plan_linears

        fp8_layers = {d.name: d.out_features for d in plan_linears(create_dit(source.config), fp8_config)
                      if d.action != KEPT}
    total = 0
    for name, shape in source.shapes.items():
        if group is not None and group_of(name) != group:
            continue
        numel = math.prod(shape)
        owner = name.rpartition(".")[0]
        if name.endswith(".weight") and owner in fp8_layers:
            total += numel + 4 * fp8_layers[owner]
        else:
            total += numel * element
    return total
