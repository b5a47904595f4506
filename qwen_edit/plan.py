"""The pipe that flows between nodes: an immutable plan, never a model.

ComfyUI caches node outputs and lets one loader feed several branches, so a
node must never change what it received. A ``PipePlan`` says *what* to run
(weights, variant, LoRAs, FP8 recipe, compile settings, attention backend, the fast forward's options);
``runtime.PlanRuntime`` decides *how* (base weights read once, variants
derived in a fixed order: LoRA fused in bf16, then FP8, then compile).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoints.variants import RELEASE_BY_PLAN_VALUE, RELEASES, ReleaseFacts
from .fast.options import SHIPPED, ForwardOptions
from .parallel.layout import ParallelChoice


class Variant(str, enum.Enum):
    """Qwen-Image-Edit releases; their facts live in :data:`.checkpoints.variants.RELEASES`."""

    EDIT = "qwen-image-edit"
    EDIT_2509 = "qwen-image-edit-2509"
    EDIT_2511 = "qwen-image-edit-2511"

    @property
    def facts(self) -> ReleaseFacts:
        return RELEASE_BY_PLAN_VALUE[self.value]

    @property
    def checkpoint_name(self) -> str:
        """The name :func:`.checkpoints.variants.detect_variant` gives this release (``"edit_2509"``...)."""
        return self.facts.name

    @classmethod
    def from_checkpoint_name(cls, name: str) -> Variant:
        """The release :func:`.checkpoints.variants.detect_variant` named ``name``."""
        return cls(RELEASES[name].plan_value)

    @property
    def max_images(self) -> int:
        return self.facts.max_images

    @property
    def zero_cond_t(self) -> bool:
        """2511 modulates reference-image tokens with timestep 0 (DiffSynth's ``zero_cond_t``)."""
        return self.facts.zero_cond_t

    @property
    def multi_image_prompt(self) -> bool:
        """2509/2511 encode prompts with "Picture N:" image slots (DiffSynth's multi-image template)."""
        return self.facts.multi_image_prompt


@dataclass(frozen=True)
class LoraChoice:
    """One fused LoRA: a file, its strength, and whether it is a Lightning few-step LoRA."""

    path: Path
    strength: float
    lightning_steps: int | None = None

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class CompileChoice:
    """Regional torch.compile of the transformer blocks (one compiled block serves all)."""

    mode: str = "default"
    dynamic: bool = True
    cuda_graphs: bool = False
    """Whole-forward CUDA graphs (``qwen_edit.fast.graphs``): one capture per input shape, then replays."""

    def describe(self) -> str:
        return self.mode + (", CUDA graphs" if self.cuda_graphs else "")


@dataclass(frozen=True)
class PipePlan:
    """Everything that defines a Qwen-Image-Edit pipeline, as a hashable value.

    ``files`` is a ``checkpoints.layouts.ModelFiles``; ``fp8`` an
    ``fp8.config.FP8Config`` (both frozen); ``forward`` the fast forward's
    :class:`~.fast.options.ForwardOptions` (which fused kernels it may use;
    the shipped choice by default). Transform nodes return
    ``dataclasses.replace`` copies; the order of ``loras`` is the order the
    user chained them, and fusion always happens before FP8 quantization.
    """

    files: Any
    variant: Variant
    variant_reason: str
    attention: str = "auto"
    loras: tuple[LoraChoice, ...] = ()
    fp8: Any = None
    compile: CompileChoice | None = None
    forward: ForwardOptions = SHIPPED
    host_blocks: int = 0
    """DiT blocks kept in page-locked host memory and copied to the GPU for each forward (0: all on the GPU)."""
    parallel: ParallelChoice | None = None
    """The GPUs one edit runs on, CFG-parallel and Ulysses degrees (:mod:`.parallel`); None: this process's device."""

    def with_lora(self, lora: LoraChoice) -> PipePlan:
        return dataclasses.replace(self, loras=(*self.loras, lora))

    def with_fp8(self, fp8_config: Any) -> PipePlan:
        return dataclasses.replace(self, fp8=fp8_config)

    def with_compile(self, choice: CompileChoice | None) -> PipePlan:
        return dataclasses.replace(self, compile=choice)

    def with_forward(self, options: ForwardOptions) -> PipePlan:
        return dataclasses.replace(self, forward=options)

    def with_parallel(self, choice: ParallelChoice | None) -> PipePlan:
        return dataclasses.replace(self, parallel=None if choice is None or choice.world == 1 else choice)

    @property
    def attention_backend(self) -> str:
        """The backend name for ``fp8.attention`` ("auto" is PyTorch SDPA's own choice)."""
        return "sdpa" if self.attention == "auto" else self.attention

    @property
    def active_loras(self) -> tuple[LoraChoice, ...]:
        """The LoRAs that change the weights, in the user's order (strength 0 is the base)."""
        return tuple(lora for lora in self.loras if lora.strength != 0)

    @property
    def lightning_steps(self) -> int | None:
        """Steps of the last Lightning LoRA with non-zero strength, if any."""
        steps = [lora.lightning_steps for lora in self.active_loras if lora.lightning_steps]
        return steps[-1] if steps else None

    def describe(self, dtype_label: str = "bf16") -> str:
        """One line per setting, for node output text and benchmark tables (``dtype_label``: the compute dtype)."""
        lines = [f"variant: {self.variant.value} ({self.variant_reason})", f"attention: {self.attention}"]
        lines += [f"lora: {lora.name} x {lora.strength:g}" for lora in self.loras]
        lines.append(f"fp8: {self.fp8.describe() if self.fp8 is not None else f'off ({dtype_label})'}")
        lines.append(f"compile: {self.compile.describe() if self.compile else 'off (eager)'}")
        lines.append(f"fast forward options: {self.forward.describe()}")
        if self.host_blocks:
            lines.append(f"DiT blocks in host memory: the last {self.host_blocks}, copied to the GPU each forward")
        if self.parallel is not None:
            lines.append(f"parallel: {self.parallel.describe()}")
        return "\n".join(lines)

    def short_label(self, dtype_label: str = "bf16", cuda_graphs_ran: bool | None = None) -> str:
        """A compact label such as ``bf16`` or ``fp8 scaled_mm_rowwise + lora x1 + compiled``.

        ``dtype_label`` names the compute dtype of a pipe without FP8 (``float32`` on a CPU). ``cuda_graphs_ran``:
        whether a run used the CUDA graphs the plan asks for (None: label the request).
        """
        parts = [dtype_label] if self.fp8 is None else [f"fp8 {self.fp8.backend}"]
        if self.fp8 is not None and self.fp8.backend == "te":
            parts[0] += f" {self.fp8.te_recipe.name}"
        if self.loras:
            parts.append("+".join(f"{lora.path.stem}x{lora.strength:g}" for lora in self.loras))
        if self.compile:
            graphs = self.compile.cuda_graphs if cuda_graphs_ran is None else cuda_graphs_ran
            parts.append("compiled" + (" + CUDA graphs" if graphs else ""))
        if self.attention not in ("auto", "sdpa"):
            parts.append(self.attention)
        if self.forward != SHIPPED:
            parts.append("options: " + ", ".join(self.forward.differences()))
        if self.host_blocks:
            parts.append(f"{self.host_blocks} blocks in host memory")
        if self.parallel is not None:
            parts.append(f"cfg {self.parallel.cfg} x ulysses {self.parallel.ulysses}")
        return " + ".join(parts)
