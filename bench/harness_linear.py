"""Single linears at Qwen-Image-Edit shapes, every FP8 backend, forward and backward (the harness's ``linear``
part).

Shapes (tokens M x in K x out N): 8192 image tokens and 300 text tokens against 3072x3072 (Q/K/V,
output projections), 3072->12288 (MLP up) and 12288->3072 (MLP down), and the 3072->18432
modulation layer at 1 token (its input is the timestep embedding).

Backends: bf16 ``nn.Linear``; fp8 weight-only (``WeightOnlyLinear``); Transformer Engine current /
delayed (calibrated with two forwards) / block (``TeLinear``); ``torch._scaled_mm`` row-wise and
tensor-wise (``ScaledMMLinear``). Each eager and compiled (``torch.compile`` of the call; TE runs
eager under compile by design, so its compiled row says so and is not timed).

Forward: ``no_grad``. Backward (LoRA training: frozen weight, gradient with respect to the input):
bf16 gradients through the fp8 forward where the backend has autograd; where it has none (scaled-mm
has no derivative) the record says "no backward" with the error. Accuracy against a float64
reference of the *unquantized* weights: MSE and relative error ``||y - ref|| / ||ref||``, overall
and per row (mean and max over rows), for the output and for the input gradient. Time: CUDA-event
median over calls rotating through ``SETS`` independent layers and inputs (so the weights are not
served from L2); TFLOP/s counts ``2 M K N`` for the forward and for the input gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from harness_core import (
    GIB,
    NOT_RUN,
    OK,
    PeakProbe,
    Runner,
    free_memory,
    guarded,
    load_pack,
    log,
    time_calls,
)
from torch import nn

load_pack()


SETS = 3
BACKENDS = ("bf16", "weight-only", "te-current", "te-delayed", "te-block", "scaled-mm-rowwise",
            "scaled-mm-tensorwise")
MODES = ("eager", "compiled")


@dataclass(frozen=True)
class Shape:
    tokens: int
    k: int
    n: int
    what: str

    @property
    def key(self) -> str:
        return f"{self.tokens}x{self.k}x{self.n}"

    @property
    def flops(self) -> int:
        return 2 * self.tokens * self.k * self.n


FULL_SHAPES = (
    Shape(8192, 3072, 3072, "image tokens, Q/K/V and output projections"),
    Shape(8192, 3072, 12288, "image tokens, MLP up"),
    Shape(8192, 12288, 3072, "image tokens, MLP down"),
    Shape(300, 3072, 3072, "text tokens, Q/K/V and output projections"),
    Shape(300, 3072, 12288, "text tokens, MLP up"),
    Shape(300, 12288, 3072, "text tokens, MLP down"),
    Shape(1, 3072, 18432, "modulation (timestep embedding, 1 token)"),
)
TINY_SHAPES = (
    Shape(64, 32, 32, "tiny square"),
    Shape(64, 32, 128, "tiny up"),
    Shape(8, 128, 32, "tiny down"),
    Shape(1, 32, 192, "tiny modulation"),
)


def measurement_id(shape: Shape, backend: str, mode: str) -> str:
    return f"linear/{shape.key}/{backend}-{mode}"


def linear_measurement_ids(shapes=FULL_SHAPES) -> list[str]:
    return [measurement_id(s, b, m) for s in shapes for b in BACKENDS for m in MODES]


# ----------------------------------------------------------------------------- accuracy


@torch.no_grad()
def accuracy(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Error of ``out`` [M, N] against ``ref`` [M, N], computed in float64.

    ``mse``: mean of squared differences; ``mse_row_max``: the largest per-row MSE; ``rel_err``:
    ``||out - ref|| / ||ref||``; ``rel_err_row_mean`` / ``rel_err_row_max``: per-row relative error
    ``||out_i - ref_i|| / ||ref_i||`` averaged / maximized over rows (rows with ``ref_i == 0`` count as
    0 when ``out_i`` is 0 too, else inf). NaN or inf anywhere in ``out`` gives NaN figures.
    """
    out64, ref64 = out.detach().to(torch.float64), ref.detach().to(torch.float64)
    out64, ref64 = out64.reshape(-1, out64.shape[-1]), ref64.reshape(-1, ref64.shape[-1])
    if not bool(torch.isfinite(out64).all()):
        nan = float("nan")
        return {"mse": nan, "mse_row_max": nan, "rel_err": nan, "rel_err_row_mean": nan, "rel_err_row_max": nan}
    diff = out64 - ref64
    row_num = torch.linalg.vector_norm(diff, dim=1)
    row_den = torch.linalg.vector_norm(ref64, dim=1)
    row_rel = torch.where(row_den > 0, row_num / row_den.clamp_min(1e-300),
                          torch.where(row_num > 0, torch.full_like(row_num, float("inf")), torch.zeros_like(row_num)))
    total_den = torch.linalg.vector_norm(ref64).item()
    total_num = torch.linalg.vector_norm(diff).item()
    return {
        "mse": diff.square().mean().item(),
        "mse_row_max": diff.square().mean(dim=1).max().item(),
        "rel_err": (total_num / total_den) if total_den > 0 else (0.0 if total_num == 0 else float("inf")),
        "rel_err_row_mean": row_rel.mean().item(),
        "rel_err_row_max": row_rel.max().item(),
    }


def reference_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 ``x @ W^T + b`` of the unquantized weight."""
    y = x.to(torch.float64) @ weight.to(torch.float64).t()
    return y if bias is None else y + bias.to(torch.float64)


def reference_input_grad(grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64 ``dL/dx = dL/dy @ W``."""
    return grad_out.to(torch.float64) @ weight.to(torch.float64)


# ----------------------------------------------------------------------------- layers


def make_layer(backend: str, linear: nn.Linear, calibration_input: torch.Tensor | None = None) -> nn.Module:
    """The backend's layer from a bf16 ``nn.Linear`` (built directly, without a capability gate, so a
    backend that cannot run here fails in its own words at the first call)."""
    from qwen_edit_hopper.fp8 import ScaledMMLinear, TeLinear, TeRecipeConfig, WeightOnlyLinear

    if backend == "bf16":
        return linear
    if backend == "weight-only":
        return WeightOnlyLinear.from_linear(linear)
    if backend.startswith("scaled-mm-"):
        return ScaledMMLinear.from_linear(linear, backend.removeprefix("scaled-mm-"))
    if backend.startswith("te-"):
        recipe = backend.removeprefix("te-")
        layer = TeLinear(linear, TeRecipeConfig(name=recipe))
        if recipe == "delayed":
            from qwen_edit_hopper.fp8 import calibrate_delayed_scaling

            if calibration_input is None:
                raise ValueError("te-delayed needs a calibration input")
            holder = nn.Sequential(layer)
            calibrate_delayed_scaling(holder, [lambda: layer(calibration_input), lambda: layer(calibration_input)])
        return layer
    raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")


@dataclass
class Case:
    """SETS independent (bf16 linear, backend layer, input, output gradient) of one shape."""

    shape: Shape
    linears: list[nn.Linear]
    layers: list[nn.Module]
    inputs: list[torch.Tensor]
    grads: list[torch.Tensor]


def make_inputs(shape: Shape, device: torch.device, seed: int, sets: int = SETS
                ) -> tuple[list[nn.Linear], list[torch.Tensor], list[torch.Tensor]]:
    """bf16 linears (weights N(0, 1/K), biases N(0, 0.02)), inputs N(0, 1) and output gradients N(0, 1)."""
    gen = torch.Generator("cpu").manual_seed(seed)
    linears, inputs, grads = [], [], []
    for _ in range(sets):
        with torch.device("meta"):
            lin = nn.Linear(shape.k, shape.n, bias=True)
        lin.weight = nn.Parameter((torch.randn(shape.n, shape.k, generator=gen) / shape.k**0.5).to(
            device=device, dtype=torch.bfloat16), requires_grad=False)
        lin.bias = nn.Parameter((torch.randn(shape.n, generator=gen) * 0.02).to(device=device, dtype=torch.bfloat16),
                                requires_grad=False)
        linears.append(lin)
        inputs.append(torch.randn(shape.tokens, shape.k, generator=gen).to(device=device, dtype=torch.bfloat16))
        grads.append(torch.randn(shape.tokens, shape.n, generator=gen).to(device=device, dtype=torch.bfloat16))
    return linears, inputs, grads


def _linear_call(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


@dataclass
class Caller:
    """Forward and forward+backward of a case, eager or through one ``torch.compile`` of :func:`_linear_call`.
    ``no_backward``: the reason to skip the backward (the eager layer has none: compiling it cannot add one)."""

    case: Case
    compiled: Callable | None = None
    no_backward: str = ""

    def fn(self) -> Callable:
        return self.compiled or _linear_call

    def forward(self, i: int) -> torch.Tensor:
        x = self.case.inputs[i]
        if self.compiled is not None and self.case.shape.tokens > 1:
            torch._dynamo.maybe_mark_dynamic(x, 0)
        with torch.no_grad():
            return self.fn()(self.case.layers[i], x)

    def forward_backward(self, i: int) -> torch.Tensor:
        x = self.case.inputs[i].detach().requires_grad_(True)
        if self.compiled is not None and self.case.shape.tokens > 1:
            torch._dynamo.maybe_mark_dynamic(x, 0)
        with torch.enable_grad():
            y = self.fn()(self.case.layers[i], x)
            y.backward(self.case.grads[i])
        return x.grad


def _rotating(fn: Callable[[int], Any], sets: int) -> Callable[[], Any]:
    state = {"i": 0}

    def call() -> Any:
        i = state["i"]
        state["i"] = (i + 1) % sets
        return fn(i)

    return call


def _bytes(layer: nn.Module) -> int:
    from qwen_edit_hopper.fp8.swap import module_bytes

    return module_bytes(layer)


def measure(caller: Caller, device: torch.device, *, warmup: int, reps: int) -> dict[str, Any]:
    """Forward and (where it exists) input-gradient figures of one case."""
    case = caller.case
    shape = case.shape
    sets = len(case.layers)
    figures: dict[str, Any] = {"tokens": shape.tokens, "k": shape.k, "n": shape.n,
                               "weight_mib": _bytes(case.layers[0]) / 2**20}
    with PeakProbe(device) as probe:
        caller.forward(0)
    figures["forward_activation_peak_mib"] = probe.figures()["activation_peak_gib"] * GIB / 2**20
    timing = time_calls(_rotating(caller.forward, sets), device, warmup=warmup, reps=reps)
    figures.update({"forward_ms": timing["ms"], "forward_min_ms": timing["min_ms"],
                    "forward_tflops": shape.flops / (timing["ms"] * 1e-3) / 1e12,
                    "first_call_s": timing["first_call_s"]})
    ref = reference_forward(case.inputs[0], case.linears[0].weight, case.linears[0].bias)
    figures.update({f"forward_{k}": v for k, v in accuracy(caller.forward(0), ref).items()})

    if caller.no_backward:
        figures["backward"] = caller.no_backward
        return figures
    try:
        grad = caller.forward_backward(0)
    except Exception as exc:  # no autograd for this backend: that is the answer for LoRA training
        figures["backward"] = f"no backward: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        return figures
    if grad is None:
        figures["backward"] = "no backward: the input got no gradient"
        return figures
    figures["backward"] = "bf16 gradients through the forward"
    with PeakProbe(device) as probe:
        caller.forward_backward(0)
    figures["forward_backward_activation_peak_mib"] = probe.figures()["activation_peak_gib"] * GIB / 2**20
    timing = time_calls(_rotating(caller.forward_backward, sets), device, warmup=warmup, reps=reps)
    backward_ms = max(timing["ms"] - figures["forward_ms"], 1e-6)
    figures.update({"forward_backward_ms": timing["ms"], "backward_ms": backward_ms,
                    "backward_tflops": shape.flops / (backward_ms * 1e-3) / 1e12})
    ref_grad = reference_input_grad(case.grads[0], case.linears[0].weight)
    figures.update({f"grad_{k}": v for k, v in accuracy(grad, ref_grad).items()})
    return figures


LINEAR_COMPARED = ("forward_ms / backward_ms: CUDA-event median rotating over {sets} layers "
                   "(backward = forward+backward "
            "minus forward, input gradient only, weight frozen); accuracy against a float64 reference of the "
            "unquantized bf16 weights")


def run_linear(runner: Runner, device: torch.device, shapes=FULL_SHAPES, *, warmup: int = 3, reps: int = 30,
               no_compile: bool = False, compile_estimate_s: float = 15.0) -> None:
    """Every (shape, backend, mode) that is selected; one record each."""
    for backend in BACKENDS:
        compiled_fn = torch.compile(_linear_call)  # one per backend (created lazily by dynamo on first call)
        for index, shape in enumerate(shapes):
            ids = {mode: measurement_id(shape, backend, mode) for mode in MODES}
            wanted = [i for i in ids.values() if runner.wants(i)]
            if not wanted:
                continue
            run_compiled = runner.wants(ids["compiled"])
            why_not = ""
            if run_compiled and backend.startswith("te-"):
                why_not = "TeLinear runs eager under torch.compile (torch.compiler.disable): same as eager"
            elif run_compiled and no_compile:
                why_not = "--no-compile"
            run_compiled = run_compiled and not why_not
            wanted = [i for i in wanted if i != ids["compiled"] or run_compiled]
            if wanted:
                _measure_shape(runner, device, backend, shape, index, ids, run_compiled, warmup, reps,
                               compile_estimate_s, compiled_fn)
            if why_not:
                runner.skip(ids["compiled"], NOT_RUN, why_not)
            free_memory()
        torch._dynamo.reset()
    log("linear part done")


def _measure_shape(runner: Runner, device: torch.device, backend: str, shape: Shape, index: int, ids: dict[str, str],
                   run_compiled: bool, warmup: int, reps: int, compile_estimate_s: float, compiled_fn) -> None:
    from qwen_edit_hopper.qwen_edit.compile import dynamo_settings

    wanted = [ids["eager"], *([ids["compiled"]] if run_compiled else [])]
    with guarded(runner, wanted, f"building {backend} layers for {shape.key}"):
        linears, inputs, grads = make_inputs(shape, device, seed=1000 + index)
        layers = [make_layer(backend, lin, x) for lin, x in zip(linears, inputs, strict=True)]
        case = Case(shape, linears, layers, inputs, grads)
        compared = LINEAR_COMPARED.format(sets=len(layers))
        eager = runner.run(ids["eager"], lambda: measure(Caller(case), device, warmup=warmup, reps=reps),
                           estimate_s=10, compared_with=compared, notes=[shape.what])
        if eager is None:
            eager = runner.store.get(ids["eager"])
        backward = eager.figures.get("backward", "") if eager is not None and eager.status == OK else ""
        no_backward = f"{backward} (eager)" if backward.startswith("no backward") else ""
        if run_compiled:
            with dynamo_settings():
                runner.run(ids["compiled"], lambda: measure(Caller(case, compiled_fn, no_backward), device,
                                                            warmup=warmup, reps=reps),
                           estimate_s=compile_estimate_s, compared_with=compared,
                           notes=[shape.what, "torch.compile(layer call), token dim dynamic"])


# ----------------------------------------------------------------------------- chart


def linear_rows(records) -> list[dict[str, Any]]:
    """Flattened ok linear records: shape key, backend, mode and figures."""
    rows = []
    for record in records:
        if not record.id.startswith("linear/") or record.status != OK:
            continue
        _, key, variant = record.id.split("/")
        backend, _, mode = variant.rpartition("-")
        rows.append({"shape": key, "backend": backend, "mode": mode, **record.figures})
    return rows


def draw_linear_chart(records, path, title: str = "") -> bool:
    """PNG: forward TFLOP/s, input-gradient TFLOP/s and forward relative error per shape and backend."""
    rows = linear_rows(records)
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    series = list(dict.fromkeys(f"{r['backend']} {r['mode']}" for r in rows))
    figure = Figure(figsize=(max(10, 1.6 * len(shapes) + 4), 11), dpi=100)
    axes = figure.subplots(3, 1)
    width = 0.8 / max(1, len(series))
    panels = (("forward_tflops", "forward TFLOP/s"), ("backward_tflops", "input-gradient TFLOP/s"),
              ("forward_rel_err", "forward relative error vs float64 (log)"))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for j, name in enumerate(series):
            values = []
            for s in shapes:
                match = [r for r in rows if r["shape"] == s and f"{r['backend']} {r['mode']}" == name]
                value = match[0].get(key) if match else None
                values.append(value if isinstance(value, (int, float)) else 0.0)
            ax.bar([i + j * width for i in range(len(shapes))], values, width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], labels=shapes, fontsize=8)
        ax.set_ylabel(label, fontsize=9)
        if key.endswith("rel_err"):
            ax.set_yscale("log")
    axes[0].legend(fontsize=7, ncol=4)
    axes[0].set_title(title or "single linears at Qwen-Image-Edit shapes (tokens x in x out)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    return True

