"""bench/harness.py --part linear on a real GPU: every shape measures for bf16 and the fp8 backends that exist.

Run on the device machine (about 2-3 minutes with the compiled variants)::

    python3 -m pytest -m gpu tests/gpu/test_bench_gpu.py -q -rs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_linear_part_runs(tmp_path, capsys):
    import harness
    import harness_linear

    assert harness.main(["--part", "linear", "--out", str(tmp_path), "--linear-reps", "10", "--budget-s", "0"]) == 0
    records = {r["id"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert set(records) == set(harness_linear.linear_measurement_ids(harness_linear.FULL_SHAPES))
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    for shape in harness_linear.FULL_SHAPES:
        for variant in ("bf16-eager", "bf16-compiled", "weight-only-eager"):
            record = records[f"linear/{shape.key}/{variant}"]
            assert record["status"] == "ok", (record["id"], record["error"])
            figures = record["figures"]
            assert figures["forward_tflops"] > 0 and figures["backward"].startswith("bf16")
        if hopper:
            rowwise = records[f"linear/{shape.key}/scaled-mm-rowwise-eager"]
            assert rowwise["status"] == "ok", rowwise["error"]
            assert rowwise["figures"]["forward_rel_err"] < 4.5e-2
            assert rowwise["figures"]["backward"].startswith("no backward")
    assert (tmp_path / "linear.png").is_file() and (tmp_path / "section.md").is_file()
    assert "LINEAR LAYERS" in capsys.readouterr().out
