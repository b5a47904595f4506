"""Does a LoRA change recompile the compiled fp8 DiT? Full size, the product's own LoRA sync path.

Full-size Qwen-Image-Edit DiT with random weights on the GPU, the fastest preset's fp8 variant
(row-wise, "attn+mlp+mod compute", fast accumulation) with the pack's regional compile; a PEFT LoRA
written for 10 of the 60 blocks (Q projection and MLP output, rank 16). The LoRA goes through what the
runtime does (`variants_dit.sync_fp8_loras`: fuse into the bf16 base, re-quantize the changed fp8
weights in place) at strengths 1.0, 0.5, -0.7, then is removed. After each change: dynamo's compiled
graph count (must not grow), the sync time, one forward's time, and the output's difference from the
no-LoRA output (must be > 0 with a LoRA, exactly 0 after removal). Run on the device:

    source bench/device_env.sh && python3 bench/lora_recompile_check.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import harness_core as hc
import harness_models as hm
from pack import load_pack


def main() -> int:
    load_pack()
    from qwen_edit_hopper.fp8 import Fp8Config
    from qwen_edit_hopper.qwen_edit import fast_forward as ff
    from qwen_edit_hopper.qwen_edit.compile import compiled_graph_count, dynamo_settings
    from qwen_edit_hopper.qwen_edit.fp8_dit import build_fp8_dit
    from qwen_edit_hopper.qwen_edit.lora import shapes_of
    from qwen_edit_hopper.qwen_edit.lora.testing import write_tiny_lora
    from qwen_edit_hopper.qwen_edit.memory import Resident
    from qwen_edit_hopper.qwen_edit.plan import LoraChoice
    from qwen_edit_hopper.qwen_edit.variants_dit import sync_fp8_loras

    device = torch.device("cuda")
    base_module = hm.build_dit(hm.FULL, device)
    inputs = hm.ForwardInputs.make(1024, 1024, 300, 3584, device)
    config = Fp8Config(backend="scaled_mm_rowwise", preset="attn+mlp+mod compute", fast_accum=True)
    base = Resident(key=("base",), module=base_module, nbytes=0, label="bf16 base")
    variant = Resident(key=("fp8",), module=build_fp8_dit(base_module, config), nbytes=0, label="fp8 variant")
    targets = [f"transformer_blocks.{i}.{m}.weight" for i in range(0, 60, 6) for m in ("attn.to_q", "img_mlp.net.2")]
    lora_path = Path(tempfile.mkdtemp()) / "check_lora.safetensors"
    write_tiny_lora(lora_path, "peft", shapes_of(base_module), rank=16, alpha=16.0, targets=targets, std=0.02)
    rows = []
    with dynamo_settings():
        ff.compile_blocks(variant.module)

        def forward():
            return hm.fast_forward(ff, variant.module, inputs)

        started = time.perf_counter()
        reference = forward()
        torch.cuda.synchronize()
        rows.append(("no LoRA (first call compiles)", compiled_graph_count(), 0.0, time.perf_counter() - started,
                     0.0))
        for label, strength in (("LoRA 1.0", 1.0), ("LoRA 0.5", 0.5), ("LoRA -0.7", -0.7), ("LoRA removed", None)):
            chain = () if strength is None else (LoraChoice(lora_path, strength),)
            started = time.perf_counter()
            assert sync_fp8_loras(variant, base, chain), "the row-wise fp8 variant must update in place"
            torch.cuda.synchronize()
            sync_s = time.perf_counter() - started
            ms = hc.time_calls(forward, device, warmup=1, reps=3)["ms"]
            out = forward()
            diff = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
            rows.append((label, compiled_graph_count(), sync_s, ms / 1e3, diff))
    print(f"\n{'step':32s} {'graphs':>6s} {'sync s':>7s} {'forward s':>9s} {'diff vs no LoRA':>15s}")
    for label, graphs, sync_s, seconds, diff in rows:
        print(f"{label:32s} {graphs:6d} {sync_s:7.2f} {seconds:9.3f} {diff:15.3e}")
    graphs = {r[1] for r in rows}
    print(f"recompiles after the first call: {len(graphs) - 1}; removal restores the output exactly: "
          f"{rows[-1][4] == 0.0}")
    return 0 if len(graphs) == 1 and rows[-1][4] == 0.0 and all(r[4] > 0 for r in rows[1:-1]) else 1


if __name__ == "__main__":
    sys.exit(main())
