"""Tiny LoRA files of every supported layout, for unit and integration tests.

``tiny_target_shapes`` mirrors the Qwen-Image DiT parameter names of DiffSynth
(``QwenImageDiT``) at toy sizes; ``write_tiny_lora`` writes a LoRA in one of
:data:`FORMATS` for such shapes (or the full-size ones) and returns the dense
delta ``scale * B @ A`` (float32) it encodes per target, so a test can check
``W' = W + strength * delta``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence

import torch
from safetensors.torch import save_file

from .names import kohya_name

__all__ = [
    "FORMATS",
    "assert_fused_close",
    "base_weights",
    "reference_fused",
    "tiny_target_shapes",
    "ulp_distance",
    "write_tiny_lora",
]

FORMATS = (
    "peft",  # <m>.lora_A.weight / .lora_B.weight (+ .alpha)
    "peft_default",  # <m>.lora_A.default.weight / .lora_B.default.weight
    "kohya",  # lora_unet_<m_>.lora_down.weight / .lora_up.weight (+ .alpha)
    "comfy_prefix",  # diffusion_model.<m>.lora_down.weight / .lora_up.weight (+ .alpha)
    "transformer_prefix",  # transformer.<m>.lora_A.weight / .lora_B.weight (+ .alpha)
    "lightning",  # <m>.lora_down.weight / .lora_up.weight (+ .alpha), as lightx2v ships them
    "loha",  # lycoris_<m_>.hada_w1_a ... (+ .alpha)
    "lokr",  # lora_unet_<m_>.lokr_w1, .lokr_w2_a, .lokr_w2_b (+ .alpha)
    "lokr_full",  # lora_unet_<m_>.lokr_w1, .lokr_w2 (scale 1 whatever alpha)
    "diff",  # diffusion_model.<m>.diff / .diff_b, also on 1-D norm weights
)

_LR_KEYS = {
    "peft": ("{m}.lora_A.weight", "{m}.lora_B.weight", "{m}.alpha"),
    "peft_default": ("{m}.lora_A.default.weight", "{m}.lora_B.default.weight", "{m}.alpha"),
    "kohya": ("lora_unet_{k}.lora_down.weight", "lora_unet_{k}.lora_up.weight", "lora_unet_{k}.alpha"),
    "comfy_prefix": (
        "diffusion_model.{m}.lora_down.weight",
        "diffusion_model.{m}.lora_up.weight",
        "diffusion_model.{m}.alpha",
    ),
    "transformer_prefix": ("transformer.{m}.lora_A.weight", "transformer.{m}.lora_B.weight", "transformer.{m}.alpha"),
    "lightning": ("{m}.lora_down.weight", "{m}.lora_up.weight", "{m}.alpha"),
}


def tiny_target_shapes(
    num_layers: int = 2,
    dim: int = 16,
    head_dim: int = 8,
    in_channels: int = 8,
    text_dim: int = 24,
    time_dim: int = 8,
    biases: bool = True,
    norms: bool = True,
) -> dict[str, tuple[int, ...]]:
    """``name -> shape`` with DiffSynth's Qwen-Image DiT names at toy sizes (FFN = 4 * dim)."""
    s: dict[str, tuple[int, ...]] = {}

    def linear(name: str, out: int, inp: int) -> None:
        s[f"{name}.weight"] = (out, inp)
        if biases:
            s[f"{name}.bias"] = (out,)

    linear("time_text_embed.timestep_embedder.linear_1", dim, time_dim)
    linear("time_text_embed.timestep_embedder.linear_2", dim, dim)
    if norms:
        s["txt_norm.weight"] = (text_dim,)
    linear("img_in", dim, in_channels)
    linear("txt_in", dim, text_dim)
    for i in range(num_layers):
        b = f"transformer_blocks.{i}"
        linear(f"{b}.img_mod.1", 6 * dim, dim)
        for name in ("to_q", "to_k", "to_v"):
            linear(f"{b}.attn.{name}", dim, dim)
        if norms:
            s[f"{b}.attn.norm_q.weight"] = (head_dim,)
            s[f"{b}.attn.norm_k.weight"] = (head_dim,)
        for name in ("add_q_proj", "add_k_proj", "add_v_proj"):
            linear(f"{b}.attn.{name}", dim, dim)
        if norms:
            s[f"{b}.attn.norm_added_q.weight"] = (head_dim,)
            s[f"{b}.attn.norm_added_k.weight"] = (head_dim,)
        linear(f"{b}.attn.to_out.0", dim, dim)
        linear(f"{b}.attn.to_add_out", dim, dim)
        linear(f"{b}.img_mlp.net.0.proj", 4 * dim, dim)
        linear(f"{b}.img_mlp.net.2", dim, 4 * dim)
        linear(f"{b}.txt_mod.1", 6 * dim, dim)
        linear(f"{b}.txt_mlp.net.0.proj", 4 * dim, dim)
        linear(f"{b}.txt_mlp.net.2", dim, 4 * dim)
    linear("norm_out.linear", 2 * dim, dim)
    linear("proj_out", in_channels, dim)
    return s


def base_weights(
    target_shapes: Mapping[str, Sequence[int]], dtype: torch.dtype = torch.bfloat16, seed: int = 0, std: float = 0.05
) -> dict[str, torch.Tensor]:
    """Random base weights (``N(0, std)``, ``dtype``, CPU) for every name in ``target_shapes``."""
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(tuple(shape), generator=g) * std).to(dtype) for n, shape in sorted(target_shapes.items())}


def _select(target_shapes, layers, targets, fmt) -> list[str]:
    if targets is not None:
        return sorted(targets)
    keep = None if layers is None else tuple(f"transformer_blocks.{i}." for i in layers)
    names = []
    for name, shape in sorted(target_shapes.items()):
        if keep is not None and not name.startswith(keep):
            continue
        if fmt == "diff" or (name.endswith(".weight") and len(shape) == 2):
            names.append(name)
    return names


def _split(n: int) -> int:
    """Largest divisor of ``n`` not above sqrt(n) (1 for primes)."""
    return max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)


def write_tiny_lora(
    path: str | os.PathLike,
    format: str,
    target_shapes: Mapping[str, Sequence[int]],
    rank: int = 4,
    alpha: float | None = None,
    seed: int = 0,
    layers: Iterable[int] | None = None,
    targets: Iterable[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    metadata: Mapping[str, str] | None = None,
    std: float = 0.2,
) -> dict[str, torch.Tensor]:
    """Write a LoRA in ``format`` (one of :data:`FORMATS`) covering the chosen targets.

    Targets: ``targets`` if given, else every 2-D ``.weight`` (all tensors for
    ``diff``) of ``target_shapes``, restricted to ``transformer_blocks.{i}`` for
    ``i in layers`` when ``layers`` is given. ``alpha`` None writes no alpha key
    (scale 1.0). Factors are ``N(0, std)`` stored as ``dtype``. Returns
    ``{target name: float32 dense delta including alpha/rank}`` computed in float64
    from the stored factors; targets that cannot take the format (LoKr on a prime
    dimension) are left out.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; expected one of {FORMATS}")
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * std).to(dtype)

    def f64(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float64)

    sd: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for name in _select(target_shapes, layers, targets, format):
        shape = tuple(target_shapes[name])
        m = name.rsplit(".", 1)[0]
        k = kohya_name(m)
        scale = 1.0 if alpha is None else float(torch.tensor(float(alpha))) / rank  # alpha as stored (float32)
        if format in _LR_KEYS:
            kd, ku, ka = (t.format(m=m, k=k) for t in _LR_KEYS[format])
            sd[kd], sd[ku] = rnd(rank, shape[1]), rnd(shape[0], rank)
            delta = f64(sd[ku]) @ f64(sd[kd])
        elif format == "loha":
            ka = f"lycoris_{k}.alpha"
            f = {}
            for n in ("w1_a", "w1_b", "w2_a", "w2_b"):
                f[n] = rnd(shape[0], rank) if n.endswith("_a") else rnd(rank, shape[1])
            sd.update({f"lycoris_{k}.hada_{n}": t for n, t in f.items()})
            delta = (f64(f["w1_a"]) @ f64(f["w1_b"])) * (f64(f["w2_a"]) @ f64(f["w2_b"]))
        elif format in ("lokr", "lokr_full"):
            a, b = _split(shape[0]), _split(shape[1])
            if a == 1 or b == 1:
                continue
            ka = f"lora_unet_{k}.alpha"
            w1 = rnd(a, b)
            sd[f"lora_unet_{k}.lokr_w1"] = w1
            if format == "lokr":
                w2a, w2b = rnd(shape[0] // a, rank), rnd(rank, shape[1] // b)
                sd[f"lora_unet_{k}.lokr_w2_a"], sd[f"lora_unet_{k}.lokr_w2_b"] = w2a, w2b
                w2 = f64(w2a) @ f64(w2b)
            else:
                w2 = f64(rnd(shape[0] // a, shape[1] // b))
                sd[f"lora_unet_{k}.lokr_w2"] = w2.to(dtype)
                scale = 1.0
            delta = torch.kron(f64(w1), w2)
        else:  # diff
            ka = None
            suffix = "diff_b" if name.endswith(".bias") else "diff"
            sd[f"diffusion_model.{m}.{suffix}"] = rnd(*shape)
            delta, scale = f64(sd[f"diffusion_model.{m}.{suffix}"]), 1.0
        if alpha is not None and ka is not None:
            sd[ka] = torch.tensor(float(alpha))
        expected[name] = (delta * scale).to(torch.float32)
    save_file(sd, os.fspath(path), metadata=dict(metadata) if metadata else None)
    return expected


def reference_fused(
    base: Mapping[str, torch.Tensor], deltas: Sequence[tuple[Mapping[str, torch.Tensor], float]]
) -> dict[str, torch.Tensor]:
    """``W + sum(strength * delta)`` in float64, rounded once to ``W``'s dtype, for every touched name.

    ``deltas`` pairs the dicts returned by :func:`write_tiny_lora` with strengths.
    """
    names = sorted({n for d, s in deltas if s != 0 for n in d})
    out = {}
    for n in names:
        acc = base[n].to(torch.float64)
        for d, s in deltas:
            if s != 0 and n in d:
                acc = acc + float(s) * d[n].to(torch.float64)
        out[n] = acc.to(base[n].dtype)
    return out


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place between two tensors of one float dtype (int64)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"need equal dtype and shape, got {a.dtype} {tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    lowest = torch.iinfo(int_dtype).min

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(int_dtype).to(torch.int64)
        return torch.where(i < 0, lowest - i, i)

    return (ordered(a) - ordered(b)).abs()


def assert_fused_close(
    fused: Mapping[str, torch.Tensor], references: Mapping[str, torch.Tensor], atol: float = 1e-6
) -> None:
    """Raise AssertionError unless ``fused`` has exactly the names of ``references`` and each
    tensor (same dtype and shape) is within 1 ulp of it, or within ``atol`` where the
    terms cancel to about zero (float32 vs float64 summation)."""
    if sorted(fused) != sorted(references):
        raise AssertionError(f"fused names differ: {sorted(set(fused) ^ set(references))[:5]}")
    for name, ref in references.items():
        got = fused[name]
        if got.dtype != ref.dtype or got.shape != ref.shape:
            raise AssertionError(f"{name}: {got.dtype} {tuple(got.shape)} vs {ref.dtype} {tuple(ref.shape)}")
        ok = (ulp_distance(got, ref) <= 1) | ((got.double() - ref.double()).abs() <= atol)
        if not bool(ok.all()):
            raise AssertionError(f"{name}: {int((~ok).sum())} of {ok.numel()} elements off the reference")
