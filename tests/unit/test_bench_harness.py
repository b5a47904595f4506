"""bench/harness.py end to end at tiny size on CPU: the same code paths the GPU run takes (random-weight
models, the runtime fed with built components, ComfyUI's model, the batched-CFG sampler, records,
tables), with compiled variants recorded as not run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import harness
import harness_core as core
import harness_e2e as e2e
import harness_models as hm
from test_checkpoints_support import COMFY_TOKENIZER_DIR, COMFYUI_DIR


@pytest.fixture
def comfy_env(monkeypatch):
    if not COMFY_TOKENIZER_DIR.is_dir():
        pytest.skip(f"ComfyUI not found at {COMFYUI_DIR}")
    monkeypatch.setenv("COMFY_DIR", str(COMFYUI_DIR))


def test_list_names_every_part():
    ids = harness.all_ids(harness.parse_args(["--list"]))
    for expected in ("linear/8192x3072x3072/scaled-mm-rowwise-compiled", "linear/1x3072x18432/te-delayed-eager",
                     "forward/ds/te-delayed-eager", "forward/comfy/fp8-e4m3fn-fast-compiled",
                     "forward/torchao/fp8-rowwise-compiled", "cfg/fast/fp8-rowwise-compiled", "cfg/ds/bf16-compiled",
                     "resolution/fast/bf16-compiled@1328x1328", "e2e/fastest-lightning-4", "e2e/bf16-eager-cfg4-40",
                     "e2e/pack-default-cfg4-40", "forward/fast/te-current-compiled"):
        assert expected in ids
    assert len(ids) == len(set(ids))


def test_full_size_refuses_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit, match="--tiny"):
        harness.main(["--part", "forward", "--out", str(tmp_path)])


@pytest.mark.slow
def test_tiny_run_on_cpu_forward_cfg_and_e2e(tmp_path, comfy_env, capsys):
    out = tmp_path / "run"
    argv = ["--tiny", "--part", "forward,cfg,e2e", "--no-compile", "--fastest", "fast/weight-only-eager", "--out",
            str(out),
            "--only", "ds/bf16-eager,forward/ds/weight-only-eager,ds/fp8-rowwise-eager,comfy/*-eager,"
                      "fast/bf16-eager,e2e/*,forward/ds/bf16-compiled"]
    assert harness.main(argv) == 0
    records = {r["id"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    status = {k: v["status"] for k, v in records.items()}
    for ok in ("forward/ds/bf16-eager", "forward/ds/weight-only-eager", "forward/comfy/bf16-eager",
               "forward/comfy/fp8-e4m3fn-fast-eager", "cfg/ds/bf16-eager", "e2e/bf16-eager-cfg4-2",
               "e2e/bf16-eager-lightning-2", "forward/fast/bf16-eager", "cfg/fast/bf16-eager",
               "e2e/pack-default-cfg4-2", "e2e/fastest-cfg4-2", "e2e/fastest-lightning-2"):
        assert status[ok] == core.OK, (ok, records[ok]["error"])
    assert status["forward/ds/bf16-compiled"] == core.NOT_RUN
    assert status["forward/ds/fp8-rowwise-eager"] == core.ERROR  # needs a GPU: its reason is the record
    assert "CUDA" in records["forward/ds/fp8-rowwise-eager"]["error"]
    comfy = records["forward/comfy/bf16-eager"]["figures"]
    assert comfy["rel_err"] == 0 and 0 < comfy["rel_err_vs_reference_A"] < 5e-2
    assert records["forward/comfy/fp8-e4m3fn-fast-eager"]["figures"]["rel_err"] > 1e-3
    baseline = records["e2e/bf16-eager-cfg4-2"]["figures"]
    assert baseline["encode_s"] > 0 and baseline["denoise_s"] > 0 and baseline["decode_s"] > 0
    assert baseline["image_finite"] and baseline["timeline"]["samples"]
    assert any("text_encoder" in m[1] for m in baseline["timeline"]["marks"])
    assert records["e2e/fastest-cfg4-2"]["figures"]["preset_variant"] == "fast/weight-only-eager"
    assert records["cfg/fast/bf16-eager"]["figures"]["batch2_vs_batch1_rel_err"] < 1e-2
    assert records["cfg/fast/bf16-eager"]["figures"]["negative_tokens"] == 5
    for name in ("section.md", "forward.png", "e2e_memory.png"):
        assert (out / name).is_file(), name
    printed = capsys.readouterr().out
    assert "NOT OK" in printed and printed.rstrip().splitlines()[-1].strip().startswith(("forward/", "cfg/", "e2e/"))

    # resume: a second run into the same folder keeps what was ok and measures nothing again
    assert harness.main(argv) == 0
    again = {r["id"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert again["forward/ds/bf16-eager"]["when"] == records["forward/ds/bf16-eager"]["when"]

    # merge two folders without a GPU
    merged = tmp_path / "merged"
    assert harness.main(["--merge", str(out), str(out / "results.json"), "--out", str(merged)]) == 0
    assert (merged / "results.json").is_file() and (merged / "section.md").is_file()


def test_runtime_takes_injected_components_and_variant(tmp_path, comfy_env):
    from qwen_edit_hopper.fp8 import Fp8Config
    from qwen_edit_hopper.qwen_edit.plan import PipePlan, Variant
    from qwen_edit_hopper.qwen_edit.runtime import PlanRuntime, vae_key

    dit = hm.build_dit("tiny", "cpu", torch.bfloat16)
    text_encoder = hm.build_text_encoder("tiny", "cpu", torch.bfloat16)
    vae = hm.build_vae("tiny", "cpu", torch.bfloat16)
    runtime = PlanRuntime("cpu", torch.bfloat16, comfy_tokenizer_dir=COMFY_TOKENIZER_DIR)
    plan = PipePlan(files=e2e.placeholder_files(tmp_path), variant=Variant.EDIT_2509, variant_reason="test")
    e2e.inject_components(runtime, plan, dit=dit, text_encoder=text_encoder, vae=vae)
    assert runtime.dit(plan).module is dit and runtime.vae(plan).module is vae
    assert runtime.processor(plan) is not None

    fp8_plan = plan.with_fp8(Fp8Config(backend="weight_only"))
    prebuilt = hm.structure_copy(dit)
    e2e.inject_variant(runtime, fp8_plan, prebuilt)
    assert runtime.dit(fp8_plan).module is prebuilt

    # a module under another key is not what the getters return: the injection fails loudly
    fresh = PlanRuntime("cpu", torch.bfloat16, comfy_tokenizer_dir=COMFY_TOKENIZER_DIR)
    fresh.adopt(("vae", "elsewhere"), vae, "stray VAE")
    fresh.adopt(vae_key(plan), hm.build_vae("tiny", "cpu", torch.bfloat16), "another VAE")
    with pytest.raises(RuntimeError, match="another module than the injected vae"):
        e2e.inject_components(fresh, plan, dit=dit, text_encoder=text_encoder, vae=vae)


def test_choose_fastest():
    store = core.ResultStore(None)
    assert e2e.choose_fastest(store, "auto")[0] == "fast/fp8-rowwise-qkv-compiled"
    # DiffSynth's forward is not a pack path: never the e2e "fastest"
    store.put(core.Record("forward/ds/fp8-rowwise-compiled", core.OK, {"ms": 150.0, "rel_err": 0.014}))
    store.put(core.Record("forward/fast/fp8-rowwise-qkv-triton-compiled", core.OK, {"ms": 200.0, "rel_err": 0.5}))
    store.put(core.Record("forward/fast/fp8-rowwise-compiled", core.OK, {"ms": 230.0, "rel_err": 0.015}))
    assert e2e.choose_fastest(store, "auto")[0] == "fast/fp8-rowwise-compiled"
    assert e2e.choose_fastest(store, "fast/bf16-compiled") == ("fast/bf16-compiled", "chosen with --fastest")
    with pytest.raises(ValueError, match="--fastest"):
        e2e.choose_fastest(store, "nope")


def test_retry_from_adds_what_the_budget_left_out(tmp_path):
    store = core.ResultStore(tmp_path)
    store.put(core.Record("forward/fast/te-current-compiled", core.NOT_RUN, error="time budget: 530 s used"))
    store.put(core.Record("forward/ds/bf16-eager", core.ERROR, error="boom"))
    sel = harness.with_retries(core.Selection.parse("e2e,linear"), [str(tmp_path)])
    assert sel.parts == ("forward", "e2e", "linear")
    assert sel.wants("forward/fast/te-current-compiled") and sel.wants("e2e/fastest-cfg4-40")
    assert sel.wants("linear/1x3072x18432/bf16-eager") and not sel.wants("forward/ds/bf16-eager")
