"""What the load-time NaN/Inf check costs (``python3 bench/product_path.py integrity ...``): ``load_tensors``
(checked) against a plain read of the same files. Every checkpoint tensor goes through
``qwen_edit.checkpoints.safetensors_io.load_tensors``, which checks each tensor for NaN/Inf on the device it lands
on (one reduction per tensor, one host sync per file). The same files are read onto ``--device`` alternately
without the check (``safe_open`` + ``get_tensor``) and with it, ``--repeats`` times each; reported: the median
seconds of both, the check alone over tensors already on the device, and the check's share of the checked load.
Files: ``--file`` (repeatable, e.g. every shard of the real DiT), or written at full DiT width
(``--synthetic-blocks N``: N blocks at dim 3072, about 680 MB each in bf16). ``--model-files DIT TEXT_ENCODER VAE``
also times loading the three as models through the pack's loaders against the check alone over their tensors.
After the first read the files sit in the page cache, so the loads measured are the fastest a load can be; a cold
read from disk is slower and the check is not, so the share reported is its upper bound. The JSON record goes to
``$OUT/integrity.json`` (and ``$OUT/integrity_models.json``) when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_read(paths: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``paths`` onto ``device`` with safetensors alone (no check)."""
    from safetensors import safe_open

    tensors = {}
    for path in paths:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                tensors[name] = handle.get_tensor(name)
    _sync_device(device)
    return tensors


def checked_read(paths: list[Path], device: torch.device) -> dict[str, torch.Tensor]:
    """The same through the pack's ``load_tensors`` (dtype and NaN/Inf checks included)."""
    from qwen_edit_hopper.qwen_edit.checkpoints.safetensors_io import load_tensors

    tensors = {}
    for path in paths:
        tensors.update(load_tensors(path, device=device))
    _sync_device(device)
    return tensors


def check_only(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The check alone over tensors already in memory (one sync); returns the non-finite names."""
    from qwen_edit_hopper.qwen_edit.checkpoints.integrity import FiniteCheck

    check = FiniteCheck()
    for name, tensor in tensors.items():
        check.add(name, tensor)
    return check.nonfinite()


def _timed_call(fn, *args):
    started = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - started, result


def measure_integrity(paths: list[Path], device: torch.device | str, repeats: int = 3) -> dict:
    """Median seconds of plain and checked reads of ``paths`` and of the check alone, and the check's share.

    The first read of each kind is a warm-up (it fills the page cache and the allocator) and is not counted.
    """
    device = torch.device(device)
    plain_s, checked_s, check_s = [], [], []
    for index in range(repeats + 1):
        seconds, tensors = _timed_call(plain_read, paths, device)
        del tensors
        seconds_checked, tensors = _timed_call(checked_read, paths, device)
        seconds_check, bad = _timed_call(check_only, tensors)
        if bad:
            raise ValueError(f"{paths}: non-finite tensors {bad[:5]}: measure on a good file")
        if index:
            plain_s.append(seconds)
            checked_s.append(seconds_checked)
            check_s.append(seconds_check)
        count, nbytes = len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        if device.type == "cuda":
            torch.cuda.empty_cache()
    plain, checked, check = (statistics.median(v) for v in (plain_s, checked_s, check_s))
    return {
        "files": [str(p) for p in paths],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "tensors": count,
        "gbytes": nbytes / 1e9,
        "repeats": repeats,
        "plain_read_s": plain,
        "checked_read_s": checked,
        "check_alone_s": check,
        "check_share_of_load": check / checked,
        "checked_minus_plain_share": (checked - plain) / plain,
        "check_gbytes_per_s": nbytes / 1e9 / check if check else float("inf"),
    }


def measure_model_loads(dit: Path, text_encoder: Path, vae: Path, device: torch.device | str, repeats: int = 3) -> dict:
    """Median seconds to load the three models through the pack's loaders (checks included), and the check
    alone over the same files' tensors on the device: the check's share of a whole model load (read, fp8
    dequantization, key conversion, building the modules)."""
    from qwen_edit_hopper.qwen_edit.checkpoints import load_dit, load_text_encoder, load_vae, resolve_single_files

    device = torch.device(device)
    files = resolve_single_files(dit, text_encoder, vae)
    load_s, check_s = [], []
    for index in range(repeats + 1):
        started = time.perf_counter()
        models = [load(files, device=device) for load in (load_dit, load_text_encoder, load_vae)]
        _sync_device(device)
        seconds = time.perf_counter() - started
        del models
        tensors = plain_read([dit, text_encoder, vae], device)
        seconds_check, _ = _timed_call(check_only, tensors)
        del tensors
        if index:
            load_s.append(seconds)
            check_s.append(seconds_check)
    load, check = statistics.median(load_s), statistics.median(check_s)
    return {"files": [str(dit), str(text_encoder), str(vae)], "device": str(device),
            "threads": torch.get_num_threads(), "repeats": repeats, "model_load_s": load, "check_alone_s": check,
            "check_share_of_load": check / load}


def write_synthetic_dit(path: Path, blocks: int, dim: int = 3072, seed: int = 0) -> Path:
    """A DiT at width ``dim`` with ``blocks`` transformer blocks, random bf16 weights (N(0, 0.02), norms 1)."""
    from qwen_edit_hopper.qwen_edit.checkpoints.dit import DiTConfig, create_dit
    from safetensors.torch import save_file

    heads = max(1, dim // 128)
    config = DiTConfig(dim=dim, num_layers=blocks, num_heads=heads, head_dim=dim // heads, text_dim=3584)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, meta in create_dit(config).state_dict(keep_vars=True).items():
        shape = tuple(meta.shape)
        if len(shape) == 1 and "norm" in name:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    save_file(tensors, str(path))
    return path


def integrity_report(record: dict) -> str:
    return (f"{record['tensors']} tensors, {record['gbytes']:.2f} GB on {record['device']} "
            f"({record['threads']} CPU threads), median of {record['repeats']}:\n"
            f"  plain read     {record['plain_read_s']:.3f} s\n"
            f"  checked read   {record['checked_read_s']:.3f} s "
            f"({100 * record['checked_minus_plain_share']:+.1f}% vs plain)\n"
            f"  check alone    {record['check_alone_s']:.4f} s ({record['check_gbytes_per_s']:.1f} GB/s), "
            f"{100 * record['check_share_of_load']:.2f}% of the checked load")


def integrity_main(argv: list[str]) -> int:
    """``product_path.py integrity ...``: the load-time check's cost (see the section comment above)."""
    parser = argparse.ArgumentParser(prog="product_path.py integrity",
                                     description="what the load-time NaN/Inf check costs against a plain read")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--file", type=Path, action="append", default=[], help="a safetensors file (repeatable)")
    parser.add_argument("--synthetic-blocks", type=int, default=0, help="write a DiT at dim 3072 with this many blocks")
    parser.add_argument("--dim", type=int, default=3072, help="width of the synthetic DiT")
    parser.add_argument("--model-files", type=Path, nargs=3, metavar=("DIT", "TEXT_ENCODER", "VAE"),
                        help="also time loading these three single files as models")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from pack import load_pack

    load_pack()
    if args.model_files:
        models = measure_model_loads(*args.model_files, args.device, args.repeats)
        print(f"models {[Path(f).name for f in models['files']]} on {models['device']} ({models['threads']} CPU "
              f"threads), median of {models['repeats']}: load {models['model_load_s']:.3f} s, check alone "
              f"{models['check_alone_s']:.4f} s = {100 * models['check_share_of_load']:.2f}% of the load")
        out = os.environ.get("OUT")
        if out:
            Path(out, "integrity_models.json").write_text(json.dumps(models, indent=2))
        if not (args.file or args.synthetic_blocks):
            return 0
    paths = list(args.file)
    with tempfile.TemporaryDirectory() as scratch:
        if args.synthetic_blocks:
            synthetic = Path(scratch) / "synthetic_dit.safetensors"
            paths.append(write_synthetic_dit(synthetic, args.synthetic_blocks, args.dim))
        if not paths:
            parser.error("give --file or --synthetic-blocks")
        record = measure_integrity(paths, args.device, args.repeats)
    print(integrity_report(record))
    out = os.environ.get("OUT")
    if out:
        Path(out, "integrity.json").write_text(json.dumps(record, indent=2))
    return 0


