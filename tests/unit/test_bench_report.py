"""Benchmark harness plumbing on CPU: selection, budget, timing, relative error, the resume-safe results
store, guarded runs, and the table / markdown record writers."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import harness as report
import harness_core as core


def test_relative_error():
    ref = torch.tensor([3.0, 4.0])
    assert core.relative_error(ref, ref) == 0.0
    assert core.relative_error(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert math.isnan(core.relative_error(torch.tensor([float("nan"), 4.0]), ref))
    assert core.relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert core.relative_error(torch.ones(2), torch.zeros(2)) == math.inf


def test_selection_parts_and_patterns():
    sel = core.Selection.parse("forward,cfg", "ds/*,comfy/bf16-eager")
    assert sel.parts == ("forward", "cfg")
    assert sel.wants("forward/ds/bf16-eager") and sel.wants("cfg/ds/fp8-rowwise-compiled")
    assert sel.wants("forward/comfy/bf16-eager") and not sel.wants("forward/comfy/bf16-compiled")
    assert not sel.wants("resolution/ds/bf16-compiled@512x512")
    assert core.Selection.parse("all").parts == core.PARTS
    assert core.Selection.parse("all", "forward/*/bf16-*").wants("forward/fast/bf16-compiled")
    with pytest.raises(ValueError, match="allowed"):
        core.Selection.parse("forwards")


def test_budget():
    now = [0.0]
    budget = core.Budget(100, clock=lambda: now[0])
    assert budget.allows(100)
    now[0] = 60
    assert budget.allows(40) and not budget.allows(41)
    assert "--only" in budget.reason(41)
    assert core.Budget(0, clock=lambda: 1e9).allows(1e9)


def test_time_calls_on_cpu_counts_calls():
    calls = []
    timing = core.time_calls(lambda: calls.append(1), torch.device("cpu"), warmup=2, reps=5)
    assert len(calls) == 7 and timing["reps"] == 5 and timing["min_ms"] <= timing["ms"] <= timing["max_ms"]
    assert timing["first_call_s"] is not None


def _runner(tmp_path, parts="all", only=None, limit=0.0):
    store = core.ResultStore(tmp_path, {"started": "2026-01-01T00:00:00+00:00", "gpu": "TestGPU", "torch": "x"})
    return core.Runner(store, core.Selection.parse(parts, only), core.Budget(limit))


def test_runner_records_errors_nan_and_budget_and_goes_on(tmp_path):
    runner = _runner(tmp_path)
    assert runner.run("forward/ds/a", lambda: {"ms": 1.0}).status == core.OK

    def boom():
        raise RuntimeError("kernel exploded")

    rec = runner.run("forward/ds/b", boom)
    assert rec.status == core.ERROR and "RuntimeError: kernel exploded" in rec.error
    assert runner.run("forward/ds/c", lambda: {"rel_err": float("nan")}).status == core.ERROR
    tight = core.Runner(runner.store, runner.selection, core.Budget(1.0))
    assert tight.run("forward/ds/d", lambda: {"ms": 1.0}, estimate_s=50).status == core.NOT_RUN
    assert core.Runner(runner.store, core.Selection.parse("cfg"), core.Budget(0)).run(
        "forward/ds/e", lambda: {"ms": 1.0}) is None
    data = json.loads((tmp_path / "results.json").read_text())
    assert {r["id"]: r["status"] for r in data["results"]} == {
        "forward/ds/a": "ok", "forward/ds/b": "error", "forward/ds/c": "error", "forward/ds/d": "not run"}
    assert data["results"][2]["figures"]["rel_err"] == "nan"


def test_store_resumes_skips_ok_and_merges(tmp_path):
    runner = _runner(tmp_path)
    runner.run("forward/ds/a", lambda: {"ms": 2.0})
    runner.run("forward/ds/b", lambda: 1 / 0)
    resumed = core.Runner(core.ResultStore(tmp_path, {"started": "later"}), runner.selection, core.Budget(0))
    assert not resumed.wants("forward/ds/a") and resumed.wants("forward/ds/b")
    assert len(resumed.store.runs) == 2
    redo = core.Runner(resumed.store, runner.selection, core.Budget(0), redo=True)
    assert redo.wants("forward/ds/a")

    other = core.ResultStore(None)
    other.put(core.Record("forward/ds/a", core.ERROR, error="late failure"))
    other.put(core.Record("forward/ds/b", core.OK, {"ms": 3.0}))
    merged = core.ResultStore(tmp_path)
    merged.merge(other)
    assert merged.figure("forward/ds/a", "ms") == 2.0  # an error never replaces an ok
    assert merged.figure("forward/ds/b", "ms") == 3.0
    fresh = core.ResultStore(None)
    fresh.fallback = merged
    assert fresh.figure("forward/ds/b", "ms") == 3.0 and fresh.figure("forward/ds/z", "ms") is None


def test_guarded_build_failure_becomes_the_error_of_each_wanted_measurement(tmp_path):
    runner = _runner(tmp_path, only="forward/ds/x,forward/ds/y")
    runner.run("forward/ds/x", lambda: {"ms": 1.0})
    with core.guarded(runner, ["forward/ds/x", "forward/ds/y", "forward/ds/z"], "building ds/x"):
        raise MemoryError("no room")
    assert runner.store.get("forward/ds/x").status == core.OK  # already measured in this run: kept
    y = runner.store.get("forward/ds/y")
    assert y.status == core.ERROR and y.error == "building ds/x failed: MemoryError: no room"
    assert runner.store.get("forward/ds/z") is None  # not selected


def _filled_store(tmp_path):
    runner = _runner(tmp_path)
    runner.run("forward/ds/bf16-eager", lambda: {"ms": 400.0, "rel_err": 0.0, "peak_gib": 40.0,
                                                 "standalone_peak_gib": 40.0, "first_call_s": 1.0},
               compared_with="reference A (DiffSynth bf16 eager)")
    runner.run("forward/ds/fp8-rowwise-compiled", lambda: {"ms": 250.0, "rel_err": 0.014, "peak_gib": 60.0,
                                                           "standalone_peak_gib": 22.0, "first_call_s": 70.0})
    runner.run("forward/comfy/bf16-compiled", lambda: {"ms": 300.0, "rel_err": 0.015})
    runner.run("forward/comfy/bf16-eager", lambda: {"ms": 360.0, "rel_err": 0.0, "rel_err_vs_reference_A": 3e-3})
    runner.run("forward/torchao/fp8-rowwise-compiled", lambda: (_ for _ in ()).throw(ImportError("no torchao")))
    runner.run("cfg/fast/bf16-compiled", lambda: {"step_ms": 560.0, "forward_ms": 300.0, "step_per_forward": 1.87,
                                                  "rel_err": 0.02, "batch2_vs_batch1_rel_err": 1e-3})
    runner.run("resolution/ds/fp8-rowwise-compiled@512x512", lambda: {"ms": 59.0, "tokens": 2348, "rel_err": 0.01})
    runner.run("e2e/bf16-eager-cfg4-40", lambda: {"total_s": 40.0, "encode_s": 1.0, "denoise_s": 38.0,
                                                  "decode_s": 1.0, "preset_variant": "ds/bf16-eager"})
    runner.run("linear/8192x3072x3072/bf16-eager", lambda: {"forward_ms": 0.1, "forward_tflops": 800.0,
                                                            "backward": "bf16 gradients through the forward",
                                                            "backward_tflops": 700.0, "forward_rel_err": 2e-3})
    runner.run("linear/8192x3072x3072/scaled-mm-rowwise-compiled",
               lambda: {"forward_ms": 0.06, "forward_tflops": 1300.0, "forward_rel_err": 3.7e-2,
                        "backward": "no backward: RuntimeError: derivative for aten::_scaled_mm is not implemented"})
    return runner.store


def test_tables_show_ratios_against_every_baseline_and_the_errors(tmp_path):
    store = _filled_store(tmp_path)
    table = report.short_table(store)
    fp8 = next(line for line in table.splitlines() if line.startswith("ds/fp8-rowwise-compiled"))
    assert "250.0" in fp8 and "1.60" in fp8 and "1.20" in fp8  # 400/250 and 300/250
    assert "ImportError: no torchao" in table
    assert "1.87" in table and "fp8" in table and "scaled-mm-rowwise-compiled" in table
    assert table.rstrip().splitlines()[-1].strip() == "forward/torchao/fp8-rowwise-compiled"  # NOT OK list last


def test_markdown_section_and_record_append(tmp_path):
    store = _filled_store(tmp_path)
    section = report.markdown_section(store, {"forward.png": "forward.png"})
    assert section.startswith("## TestGPU, 2026-01-01")
    for text in ("### Per DiT forward", "| ds/fp8-rowwise-compiled | 250.0 | 1.60 | 1.20 |", "### Per true-CFG step",
                 "### Resolution", "### End to end", "### Linear layers", "3.00e-03", "![forward.png](forward.png)",
                 "What each figure is compared with", "no backward"):
        assert text in section, text
    record = report.write_record(section, "TestGPU", tmp_path / "performance")
    report.write_record(section, "TestGPU", tmp_path / "performance")
    text = record.read_text()
    assert record.name == "TestGPU.md"
    assert text.startswith("# Performance on TestGPU")
    assert text.count("## TestGPU") == 1 and text.count("## Method") == 1
    assert report.draw_forward_chart(store, tmp_path / "forward.png")


def test_record_run_rewrites_the_card_file_with_its_charts(tmp_path):
    store = _filled_store(tmp_path)
    (tmp_path / "forward.png").write_bytes(b"png")
    folder = tmp_path / "docs" / "performance"
    path = report.record_run(store, tmp_path, {"forward.png": "forward.png"}, folder)
    assert path == folder / "TestGPU.md"
    assert (folder / "TestGPU" / "forward.png").read_bytes() == b"png"
    assert "](TestGPU/forward.png)" in path.read_text()
    assert "- Commit: " in path.read_text()


@pytest.mark.parametrize(("gpu", "card"), [("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100"),
                                           ("NVIDIA H100 PCIe", "H100"), ("CPU", "CPU")])
def test_card_name(gpu, card):
    assert report.card_name(gpu) == card


def test_env_info_on_cpu():
    info = report.env_info(torch.device("cpu"), "python3 bench/harness.py --tiny")
    assert info["gpu"] == "CPU" and info["torch"] == torch.__version__ and info["command"].endswith("--tiny")
    assert info["commit"] is None or len(info["commit"]) >= 7


def test_load_results_from_files_and_folders(tmp_path):
    first = core.ResultStore(tmp_path / "call1")
    first.put(core.Record("forward/ds/bf16-eager", core.OK, {"ms": 400.0}))
    prior = tmp_path / "prior"
    prior.mkdir()
    (prior / "call2.json").write_text((tmp_path / "call1" / "results.json").read_text())
    second = core.ResultStore(prior / "call3.json")
    second.put(core.Record("forward/fast/bf16-compiled", core.OK, {"ms": 290.0}))
    merged = core.load_results([str(prior)])
    assert merged.figure("forward/ds/bf16-eager", "ms") == 400.0
    assert merged.figure("forward/fast/bf16-compiled", "ms") == 290.0
    assert core.load_results([tmp_path / "call1"]).figure("forward/ds/bf16-eager", "ms") == 400.0
    with pytest.raises(FileNotFoundError, match="no results json"):
        core.load_results([tmp_path / "nothing"])
