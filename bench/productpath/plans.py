"""Plans and jobs of bench/product_path.py: which servers start, with which arguments and caches, and the jobs
each runs."""

from __future__ import annotations

from dataclasses import dataclass

SHIPPED = ("fastest", "lightning_4step", "low_vram", "lora_fused", "bf16_baseline", "te_fp8", "benchmark",
           "comfy_model_fp8")
MODEL_PATH = "comfy_model_fp8"
"""The shipped workflow of ComfyUI core's nodes with Apply TE-FP8 and Compile Model on its MODEL: it quantizes
high-precision weights, so its plans run on the bf16 DiT (``--dit bf16``)."""
ALIASES = {"lightning": "lightning_4step"}

# Seconds a job takes at full size on an H100 or H200 (first on its server, later), for the deadline before a job of
# that kind has run in this run; measured durations replace them. Near the longest measured: core:compile's first
# prompt 285-377 s on empty caches, the MODEL path's 83-126 s, a free job (it waits for the unload) 18-42 s.
ESTIMATE_S = {
    "fastest": (110, 20), "lightning_4step": (80, 6), "low_vram": (90, 45), "lora_fused": (90, 20),
    "bf16_baseline": (110, 45), "te_fp8": (110, 45), "benchmark": (240, 120), "core": (110, 45),
    "core:compile": (380, 35), "free": (45, 45), "lora_change": (45, 45), MODEL_PATH: (130, 20),
}
SERVER_START_ESTIMATE_S = 30.0


@dataclass(frozen=True)
class ServerSpec:
    """One ComfyUI process: its label, extra arguments, caches (``fresh`` or ``reuse``: the previous server's)."""

    label: str
    jobs: str
    args: tuple[str, ...] = ()
    caches: str = "fresh"


@dataclass(frozen=True)
class Plan:
    """What one device command runs: the ComfyUI version it needs, the files it uses, its servers in order."""

    comfyui: str
    servers: tuple[ServerSpec, ...]
    description: str = ""


def _every_workflow_twice() -> str:
    order = ("fastest", "lightning_4step", "low_vram", "lora_fused", "te_fp8", "benchmark", "bf16_baseline")
    return ",".join(f"{name}*2,free" for name in order)


def _twenty_and_warm_cache(comfyui: str, defaults: str) -> Plan:
    return Plan(comfyui, (
        ServerSpec("twenty", "fastest:vary*20"),
        ServerSpec("warm-cache", "fastest,fastest", caches="reuse"),
    ), description=f"{defaults}: 20 fastest prompts in a row on a fresh server, each with a new seed and prompt "
                    "(the first one compiles); a second server on the first one's Inductor/Triton caches: its first "
                    "fastest image and one more")


def _model_path_plan(comfyui: str) -> Plan:
    """ComfyUI core's own workflow with and without TorchCompileModel, the MODEL path and the pack's fastest on one
    server (the bf16 DiT: ``--dit bf16``)."""
    return Plan(comfyui, (
        ServerSpec("model", f"core*2,free,core:compile*2,free,{MODEL_PATH}*3,free,fastest*2"),
    ), description=f"{comfyui} defaults, the bf16 DiT (--dit bf16): ComfyUI core's own workflow x2, with "
                   "TorchCompileModel x2, the same graph with Apply TE-FP8 and Compile Model on its MODEL x3, "
                   "then the pack's fastest x2 on the same card")


PLANS: dict[str, Plan] = {
    "v075-first-images": Plan("0.3.75", (
        ServerSpec("cold", "fastest,fastest*3,lightning*2,lightning:lora=8"),
        ServerSpec("warm-cache", "fastest,free,low_vram*2", caches="reuse"),
    ), description="0.3.75 defaults: cold fastest, warm fastest x3, Lightning x2 and a LoRA change; a second server "
                    "on the first one's Inductor/Triton caches: its first fastest image, then low VRAM x2"),
    "v075-twenty": Plan("0.3.75", (
        ServerSpec("twenty", "fastest:vary*20"),
    ), description="0.3.75 defaults: 20 fastest prompts in a row on a fresh server, each with a new "
                    "seed and prompt (the first one compiles)"),
    "v075-twenty-warm-cache": _twenty_and_warm_cache("0.3.75", "0.3.75 defaults"),
    "v075-start": Plan("0.3.75", (
        ServerSpec("cold", "fastest,fastest"),
        ServerSpec("warm-cache", "fastest,fastest", caches="reuse"),
    ), description="0.3.75 defaults: the cold-start rows alone: a fresh server's first fastest image with empty "
                    "Inductor/Triton caches and one more, then a second server on those caches: its first and one "
                    "more"),
    "v075-core": Plan("0.3.75", (
        ServerSpec("core", "core*2,free,core:compile*2,free,fastest*2"),
    ), description="0.3.75 defaults: ComfyUI core's own workflow x2, with TorchCompileModel x2, "
                                 "then the pack's fastest x2 on the same card"),
    "v033-defaults": Plan("0.33.0", (
        ServerSpec("dynamic-vram", _every_workflow_twice()),
    ), description="0.33.0 defaults (dynamic VRAM on): every shipped workflow twice with new seeds, /free between"),
    "v033-no-dynamic-vram": Plan("0.33.0", (
        ServerSpec("no-dynamic-vram", _every_workflow_twice(), args=("--disable-dynamic-vram",)),
    ), description="0.33.0 with --disable-dynamic-vram: every shipped workflow twice with new seeds, /free between"),
    "v033-twenty-warm-cache": _twenty_and_warm_cache("0.33.0", "0.33.0 defaults (dynamic VRAM on)"),
    "v033-core": Plan("0.33.0", (
        ServerSpec("core", "core*2,free,core:compile*2,free,fastest*2"),
    ), description="0.33.0 defaults: ComfyUI core's own workflow x2, with TorchCompileModel x2, "
                                 "then the pack's fastest x2 on the same card"),
    "v075-model": _model_path_plan("0.3.75"),
    "v033-model": _model_path_plan("0.33.0"),
    "v033-model-vram": Plan("0.33.0", (
        ServerSpec("no-dynamic-vram", f"{MODEL_PATH}*2,free,fastest", args=("--disable-dynamic-vram",)),
        ServerSpec("dynamic-vram", f"{MODEL_PATH}*2,free,fastest"),
    ), description="0.33.0, the bf16 DiT (--dit bf16): the same graph with Apply TE-FP8 and Compile Model on its "
                   "MODEL x2, /free, then the pack's fastest, first with --disable-dynamic-vram, then with dynamic "
                   "VRAM (0.33's default)"),
    "tiny-smoke": Plan("any", (
        ServerSpec("smoke", "low_vram,free,lora_fused"),
    ), description="two workflows without compilation (the CPU test)"),
    "tiny-all": Plan("any", (
        ServerSpec("cold", "fastest,fastest:vary*2,lightning,lightning:lora=8,free,low_vram,free,lora_fused,"
                           "bf16_baseline,te_fp8,benchmark,free,core"),
        ServerSpec("warm-cache", "fastest", caches="reuse"),
    ), description="every kind of job once or twice (a rehearsal at the tiny sizes)"),
}


@dataclass
class Job:
    """One expanded job of a spec."""

    name: str
    options: dict[str, str]
    series: str
    index: int
    repeat: int

    @property
    def kind(self) -> str:
        if self.name in ("core", "free"):
            return self.name
        return "shipped"

    @property
    def estimate_key(self) -> str:
        if "lora" in self.options or "strength" in self.options:
            return "lora_change"
        if self.name == "core" and "compile" in self.options:
            return "core:compile"
        return self.name

    @property
    def label(self) -> str:
        return ":".join([self.name, *(k if v == "" else f"{k}={v}" for k, v in self.options.items())])


def parse_jobs(spec: str) -> list[Job]:
    """``"fastest*3,lightning:lora=8,free"`` -> jobs; raises ValueError naming a bad item."""
    jobs: list[Job] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        body, _, repeat = item.partition("*")
        name, *opts = body.split(":")
        name = ALIASES.get(name, name)
        if name not in (*SHIPPED, "core", "free"):
            raise ValueError(f"job {item!r}: unknown name {name!r}; expected one of {(*SHIPPED, 'core', 'free')}")
        options = {}
        for opt in opts:
            key, _, value = opt.partition("=")
            if key not in ("vary", "lora", "strength", "graphs", "compile", "seed", "host_blocks"):
                raise ValueError(f"job {item!r}: unknown option {key!r}")
            options[key] = value
        _check_lora_options(item, name, options)
        count = int(repeat) if repeat else 1
        jobs += [Job(name, options, item, i, count) for i in range(count)]
    return jobs


LORA_WORKFLOWS = ("lightning_4step", "lora_fused", MODEL_PATH)
"""Workflows a ``lora=``/``strength=`` option applies to: the two with a Fuse LoRA node, and the MODEL path (where
it adds ComfyUI's LoraLoaderModelOnly)."""


def _check_lora_options(item: str, name: str, options: dict[str, str]) -> None:
    """Refuse a ``lora=``/``strength=`` option that would be ignored or fail mid-run: on a workflow without a LoRA,
    a LoRA other than the 4- and 8-step files, a strength that is not a number."""
    if not {"lora", "strength"} & options.keys():
        return
    if name not in LORA_WORKFLOWS:
        raise ValueError(f"job {item!r}: lora=/strength= apply to {LORA_WORKFLOWS} only")
    if "lora" in options and options["lora"] not in ("4", "8"):
        raise ValueError(f"job {item!r}: lora={options['lora']!r}; expected lora=4 or lora=8 (the Lightning files)")
    if "strength" in options:
        try:
            float(options["strength"])
        except ValueError:
            raise ValueError(f"job {item!r}: strength={options['strength']!r} is not a number") from None
