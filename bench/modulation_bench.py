"""The 120 modulation linears of a Qwen-Image DiT forward: per-layer ``_scaled_mm`` against one shared launch.

Each block's ``img_mod.1`` / ``txt_mod.1`` (3072 -> 18432, row-wise fp8) on the same one or two rows. Times,
per forward (120 layers, CUDA events, median of alternating rounds, each call sequence captured in a CUDA
graph so host launch cost is out): 120 ``ScaledMMLinear`` calls; one
:class:`qwen_edit_hopper.fp8.shared_input_gemv.SharedInputLinears` launch at several tile configurations,
with the bandwidth it reaches (6.8 GB of e4m3 weights). Also checks each configuration against the
layers' own outputs. Run from the repo root on an H100 / H200::

    source bench/device_env.sh && python3 bench/modulation_bench.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness_core as hc

CONFIGS = (
    (64, 128, 4, 4),
    (32, 128, 4, 4),
    (32, 256, 4, 4),
    (16, 128, 4, 4),
    (64, 128, 4, 6),
    (16, 256, 4, 1, "fma"),
    (16, 512, 4, 1, "fma"),
    (32, 256, 4, 1, "fma"),
    (8, 512, 2, 1, "fma"),
    (16, 512, 8, 1, "fma"),
    (32, 512, 8, 2, "fma"),
    (16, 256, 4, 3, "fma"),
    (16, 256, 8, 2, "fma"),
    (8, 512, 4, 3, "rowsum"),
    (16, 512, 4, 3, "rowsum"),
    (16, 256, 4, 4, "rowsum"),
    (32, 256, 8, 3, "rowsum"),
    (8, 1024, 8, 2, "rowsum"),
    (16, 1024, 8, 3, "rowsum"),
    (4, 1024, 4, 3, "rowsum"),
    (32, 512, 8, 3, "rowsum"),
    (64, 256, 8, 3, "rowsum"),
    (16, 512, 8, 4, "rowsum"),
    (8, 512, 4, 1, "rowsum"),
    (32, 128, 4, 4, "rowsum"),
    (8, 1024, 4, 1, "fma"),
    (4, 1024, 2, 1, "fma"),
    (8, 1024, 8, 1, "fma"),
    (4, 1024, 4, 1, "fma"),
    (16, 1024, 8, 1, "fma"),
    (8, 1024, 4, 2, "fma"),
    (2, 1024, 1, 1, "fma"),
    (4, 512, 1, 1, "fma"),
    (2, 1024, 2, 1, "rowsum"),
    (4, 1024, 2, 2, "rowsum"),
    (8, 1024, 4, 2, "rowsum"),
    (4, 1024, 2, 3, "rowsum"),
    (4, 1024, 2, 4, "rowsum"),
    (2, 1024, 1, 2, "rowsum"),
    (2, 1024, 2, 2, "rowsum"),
    (2, 1024, 2, 3, "rowsum"),
    (4, 1024, 4, 2, "rowsum"),
    (4, 1024, 1, 2, "rowsum"),
    (8, 1024, 2, 2, "rowsum"),
    (4, 512, 2, 3, "rowsum"),
    (4, 512, 1, 2, "rowsum"),
    (8, 512, 2, 3, "rowsum"),
    (2, 512, 1, 3, "rowsum"),
    (64, 128, 4, 3, "swapped"),
    (64, 128, 4, 5, "swapped"),
    (64, 256, 4, 3, "swapped"),
    (64, 256, 4, 4, "swapped"),
    (128, 128, 4, 3, "swapped"),
    (128, 128, 4, 5, "swapped"),
    (128, 256, 4, 3, "swapped"),
    (128, 128, 8, 4, "swapped"),
    (64, 512, 4, 2, "swapped"),
    (32, 256, 4, 4, "swapped"),
)
"""(BN, BK, num_warps, num_stages[, "fma": the kernel without tensor cores, (BN, BK) partials | "rowsum": the same
with a (BN,) accumulator reduced every K step (the pack's one-row default) | "swapped": tensor cores with the weight
rows on the MMA's M side, this bench's own kernel])."""


def tried_kernels():
    """A kernel tried in the twelfth session and not kept in the pack (slower than the FMA kernels): ``swapped``,
    tensor cores with the weight rows on the MMA's M side (no per-element conversion). (The ``rowsum`` kernel
    tried beside it is the pack's one-row kernel now.)"""
    import triton
    import triton.language as tl

    @triton.jit
    def _shared_input_gemv_swapped_kernel(x_ptr, x_scale_ptr, w_table, s_table, b_table, out_ptr, n,
                                          ROWS: tl.constexpr, K: tl.constexpr, BR: tl.constexpr,  # noqa: N803
                                          BN: tl.constexpr, BK: tl.constexpr,  # noqa: N803
                                          HAS_BIAS: tl.constexpr):  # noqa: N803
        """The tensor-core product transposed: acc (BN, BR) = w (BN, BK) . x^T (BK, BR), so the weight rows
        are the MMA's M side (64 / 128: Hopper's warpgroup MMA) and the few input rows, padded to BR, its N
        side. e4m3 x e4m3 (quantized input only); no per-element conversion of the weight."""
        layer = tl.program_id(1)
        w_ptr = tl.load(w_table + layer).to(tl.pointer_type(tl.float8e4nv))
        s_ptr = tl.load(s_table + layer).to(tl.pointer_type(tl.float32))
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        offs_r = tl.arange(0, BR)
        offs_k = tl.arange(0, BK)
        n_ok = offs_n < n
        r_ok = offs_r < ROWS
        acc = tl.zeros((BN, BR), dtype=tl.float32)
        for k0 in range(0, K, BK):
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :], mask=n_ok[:, None],
                        other=0.0)  # fmt: skip
            xt = tl.load(x_ptr + offs_r[None, :] * K + (k0 + offs_k)[:, None], mask=r_ok[None, :], other=0.0)
            acc = tl.dot(w, xt, acc)
        acc = acc * tl.load(x_scale_ptr + offs_r, mask=r_ok, other=0.0)[None, :]
        acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
        if HAS_BIAS:
            b_ptr = tl.load(b_table + layer).to(tl.pointer_type(tl.bfloat16))
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        out = out_ptr + layer.to(tl.int64) * ROWS * n + offs_r[None, :] * n + offs_n[:, None]
        tl.store(out, acc.to(tl.bfloat16), mask=n_ok[:, None] & r_ok[None, :])

    def launch(group, x: torch.Tensor, config: tuple) -> torch.Tensor:
        """``group(x)`` (a :class:`SharedInputLinears`) through one of the tried kernels."""
        rows, k = x.shape
        n = group.out_features
        x_in, x_scale = group.layers[0].quantize_input(x.contiguous())
        x_scale = x_scale.reshape(-1).float().expand(rows).contiguous()
        out = torch.empty((len(group.layers), rows, n), dtype=torch.bfloat16, device=x.device)
        block_n, block_k, warps, stages, kind = config
        grid = (triton.cdiv(n, block_n), len(group.layers))
        common = {"ROWS": rows, "K": k, "BN": block_n, "BK": block_k, "num_warps": warps, "num_stages": stages,
                  "HAS_BIAS": group.layers[0].bias is not None}
        assert kind == "swapped", kind
        _shared_input_gemv_swapped_kernel[grid](x_in, x_scale, group._w_table, group._s_table, group._b_table, out,
                                                n, BR=16, **common)
        return out

    return launch


def read_probe(layers, device):
    """What reading the 120 weights alone takes: a Triton kernel that sums each program's bytes (the weights'
    read bandwidth on this GPU, the floor of any kernel that reads them once)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read_kernel(table, out, numel, BLOCK: tl.constexpr):  # noqa: N803
        ptr = tl.load(table + tl.program_id(1)).to(tl.pointer_type(tl.uint8))
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(ptr + offs, mask=offs < numel, other=0)
        tl.store(out + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), tl.sum(v.to(tl.int32), axis=0))

    table = torch.tensor([layer.weight.data_ptr() for layer in layers], dtype=torch.int64, device=device)
    numel = layers[0].weight.numel()

    def run(block: int) -> torch.Tensor:
        grid = (triton.cdiv(numel, block), len(layers))
        out = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=device)
        _read_kernel[grid](table, out, numel, BLOCK=block, num_warps=8)
        return out

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    hc.load_pack()
    from qwen_edit_hopper.fp8.linear import ScaledMMLinear
    from qwen_edit_hopper.fp8.shared_input_gemv import SharedInputLinears

    device = torch.device("cuda")
    layers = []
    for _ in range(120):
        linear = torch.nn.Linear(3072, 18432, device=device, dtype=torch.bfloat16)
        torch.nn.init.normal_(linear.weight, std=0.02)
        layers.append(ScaledMMLinear.from_linear(linear, "rowwise", fast_accum=True))
        del linear
    weight_bytes = sum(layer.weight.numel() for layer in layers)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    # what plain copies of as many bytes reach (each reads the 6.8 GB and writes as much): the GPU's streaming
    # bandwidth under these conditions, against which the kernels' read-only figures are set
    flat = [layer.weight.view(torch.uint8).reshape(-1) for layer in layers]
    buffer = torch.empty(sum(t.numel() for t in flat), dtype=torch.uint8, device=device)
    other = torch.empty_like(buffer)
    copies = {"torch.cat of the weights (reads, writes as much)": lambda: torch.cat(flat, out=buffer),
              "one contiguous copy (reads, writes as much)": lambda: other.copy_(buffer)}
    for rows in args.rows:
        x = torch.randn(rows, 3072, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            want = torch.stack([layer(x) for layer in layers]).float()
        fns = {"120 x ScaledMMLinear": lambda x=x: [layer(x) for layer in layers]}
        fns.update(copies)
        probe = read_probe(layers, device)
        for block in (4096, 16384):
            fns[f"read probe (bytes summed, {block} per program)"] = lambda block=block, probe=probe: probe(block)
        errors = {}
        tried = tried_kernels()
        for config in CONFIGS:
            group = SharedInputLinears(layers)
            group.config = config
            call = group if config[4:] != ("swapped",) else lambda x, g=group, c=config, t=tried: t(g, x, c)
            try:
                got = call(x).float()
            except Exception as exc:  # a configuration Triton cannot compile is reported, not fatal
                errors[str(config)] = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            errors[str(config)] = ((got - want).norm() / want.norm()).item()
            name = f"shared-input BN {config[0]} BK {config[1]} w{config[2]} s{config[3]} {''.join(config[4:])}"
            fns[name] = lambda call=call, x=x: call(x)
        replays = {name: hc.capture_cuda_graph(fn, warmups=1)[0].replay for name, fn in fns.items()}
        times: dict[str, list[float]] = {name: [] for name in replays}
        for _ in range(5):
            for name, replay in replays.items():
                times[name].append(hc.time_calls(replay, device, warmup=1, reps=5)["ms"])
        table = {
            name: {"ms": round(statistics.median(ts), 3), "TB/s": round(weight_bytes / statistics.median(ts) / 1e9, 2)}
            for name, ts in times.items()
        }
        results["rows"][rows] = {"times": table, "rel_err_vs_layers": errors}
        print(f"\nrows {rows}: relative error vs the layers {errors}")
        for name, row in table.items():
            print(f"  {name:44s} {row['ms']:7.3f} ms  {row['TB/s']:5.2f} TB/s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "modulation.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
