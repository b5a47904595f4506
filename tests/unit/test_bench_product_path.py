"""The product-path tool's parts that need no server: the files it writes (same names, dtypes and shapes as the
tiny checkpoint fixture, aligned, readable), job specs, the prompts it queues, and how it reads the Sampler's
report, the server log and a run's results."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from comfy_server import COMFYUI_DIR
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import full_size_files  # noqa: E402
import product_path as pp  # noqa: E402
from productpath import logs, plans, prompts, sampling  # noqa: E402
from productpath import record as records  # noqa: E402
from qwen_edit_hopper.qwen_edit.tiny import write_tiny_checkpoints  # noqa: E402

TOKENIZER = COMFYUI_DIR / "comfy" / "text_encoders" / "qwen25_tokenizer"
FILES = prompts.ModelFiles("dit.safetensors", "te.safetensors", "vae.safetensors",
                      {4: "lightning4.safetensors", 8: "lightning8.safetensors"})


def _layout(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(path), "pt") as handle:
        return {k: (handle.get_slice(k).get_dtype(), tuple(handle.get_slice(k).get_shape())) for k in handle.keys()}  # noqa: SIM118


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    return full_size_files.write_all(models, size="tiny", loras=(4,), lora_rank=4, device="cpu")


def test_tiny_files_have_the_fixtures_names_dtypes_and_shapes(written, tmp_path):
    record = written
    fixture = write_tiny_checkpoints(tmp_path, "comfy_single", comfy_tokenizer_dir=TOKENIZER)
    pairs = {"dit": fixture["dit_fp8"], "text_encoder": fixture["text_encoder_fp8"], "vae": fixture["vae"][0]}
    for role, expected in pairs.items():
        assert _layout(Path(record["files"][role]["path"])) == _layout(expected), role


def test_files_are_aligned_and_scaled_fp8_weights_use_their_scale(written):
    record = written
    for entry in record["files"].values():
        path = Path(entry["path"])
        header_len = int.from_bytes(path.read_bytes()[:8], "little")
        assert header_len % 8 == 0
        header = json.loads(path.read_bytes()[8 : 8 + header_len])
        header.pop("__metadata__")
        for name, info in header.items():
            size = {"F32": 4, "BF16": 2, "F8_E4M3": 1}[info["dtype"]]
            assert info["data_offsets"][0] % size == 0, (path.name, name)
        assert path.stat().st_size == 8 + header_len + max(i["data_offsets"][1] for i in header.values())
    with safe_open(record["files"]["text_encoder"]["path"], "pt") as handle:
        keys = set(handle.keys())
        assert "lm_head.weight" not in keys and "scaled_fp8" in keys
        weight = handle.get_tensor("model.layers.0.mlp.down_proj.weight")
        scale = handle.get_tensor("model.layers.0.mlp.down_proj.scale_weight")
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == ()
    assert weight.float().abs().max() == 448.0  # the largest value maps to e4m3's largest: scale = amax / 448


def test_lora_file_is_lightx2v_layout_on_every_block_linear(written):
    record = written
    layout = _layout(Path(record["files"]["lora_4"]["path"]))
    dit = _layout(Path(record["files"]["dit"]["path"]))
    linears = {k[: -len(".weight")]: s for k, (_, s) in dit.items()
               if k.startswith("transformer_blocks.") and k.endswith(".weight") and len(s) == 2}
    assert len(layout) == 3 * len(linears)
    for module, (out_features, in_features) in linears.items():
        assert layout[f"{module}.lora_down.weight"] == ("BF16", (4, in_features))
        assert layout[f"{module}.lora_up.weight"] == ("BF16", (out_features, 4))
        assert layout[f"{module}.alpha"] == ("F32", ())


def test_the_same_seed_writes_the_same_bytes(tmp_path):
    first = full_size_files.write_all(tmp_path / "a", size="tiny", dit="none", loras=(), device="cpu")
    second = full_size_files.write_all(tmp_path / "b", size="tiny", dit="none", loras=(), device="cpu")
    for role in ("text_encoder", "vae"):
        assert Path(first["files"][role]["path"]).read_bytes() == Path(second["files"][role]["path"]).read_bytes()


def test_job_specs_expand_and_bad_ones_are_named():
    jobs = plans.parse_jobs("fastest*3, lightning:lora=8,free,core:compile*2")
    assert [j.label for j in jobs] == ["fastest"] * 3 + ["lightning_4step:lora=8", "free", "core:compile"] * 1 + [
        "core:compile"]
    assert [j.index for j in jobs[:3]] == [0, 1, 2] and jobs[0].series == "fastest*3"
    assert jobs[3].estimate_key == "lora_change" and jobs[5].estimate_key == "core:compile"
    with pytest.raises(ValueError, match="unknown name 'fastset'"):
        plans.parse_jobs("fastset")
    with pytest.raises(ValueError, match="unknown option 'grpahs'"):
        plans.parse_jobs("fastest:grpahs=off")
    # LoRA options are checked before any server starts: values, and the workflows that take a LoRA
    with pytest.raises(ValueError, match=r"job 'fastest:strength=0.5': lora=/strength= apply to .*lightning_4step"):
        plans.parse_jobs("fastest:strength=0.5")
    with pytest.raises(ValueError, match="lora='2'; expected lora=4 or lora=8"):
        plans.parse_jobs(f"{plans.MODEL_PATH}:lora=2")
    with pytest.raises(ValueError, match="strength='strong' is not a number"):
        plans.parse_jobs("lightning:strength=strong")
    assert plans.parse_jobs(f"{plans.MODEL_PATH}:lora=8:strength=0.3")[0].options == {"lora": "8", "strength": "0.3"}
    for plan in plans.PLANS.values():
        for server in plan.servers:
            assert plans.parse_jobs(server.jobs)


def test_shipped_prompt_takes_the_written_files_seed_text_and_lora():
    job = plans.parse_jobs("lightning:lora=8:strength=0.5")[0]
    prompt = prompts.shipped_prompt(job, FILES, seed=7, text="make it blue", tiny=False)
    nodes = {n["class_type"]: n["inputs"] for n in prompt.values()}
    assert nodes["QwenEditHopper_Load"]["diffusion_model"] == "dit.safetensors"
    assert nodes["QwenEditHopper_Load"]["text_encoder"] == "te.safetensors"
    assert nodes["QwenEditHopper_FuseLoRA"] == {**nodes["QwenEditHopper_FuseLoRA"],
                                                "lora_name": "lightning8.safetensors", "strength": 0.5}
    assert nodes["QwenEditHopper_Sampler"]["seed"] == 7 and nodes["QwenEditHopper_Sampler"]["prompt"] == "make it blue"
    assert nodes["QwenEditHopper_Sampler"]["steps"] == 4  # the workflow's own
    fastest = prompts.shipped_prompt(plans.parse_jobs("fastest:graphs=off")[0], FILES, seed=1, text=None, tiny=True)
    nodes = {n["class_type"]: n["inputs"] for n in fastest.values()}
    assert nodes["QwenEditHopper_Compile"]["cuda_graphs"] is False
    assert nodes["QwenEditHopper_Sampler"]["steps"] == prompts.TINY_STEPS
    assert nodes["QwenEditHopper_Sampler"]["width"] == prompts.TINY_SIZE
    assert nodes["QwenEditHopper_Sampler"]["prompt"] == prompts.PROMPT


def test_the_model_path_workflow_takes_the_written_files_seed_and_text():
    job = plans.parse_jobs(plans.MODEL_PATH)[0]
    prompt = prompts.shipped_prompt(job, FILES, seed=9, text="make it blue", tiny=True)
    nodes = {n["class_type"]: n["inputs"] for n in prompt.values()}
    assert nodes["UNETLoader"]["unet_name"] == "dit.safetensors" and nodes["VAELoader"]["vae_name"] == "vae.safetensors"
    assert nodes["CLIPLoader"]["clip_name"] == "te.safetensors"
    sampler = nodes["KSampler"]
    assert sampler["seed"] == 9 and sampler["steps"] == prompts.TINY_STEPS
    assert prompt[sampler["positive"][0]]["inputs"]["prompt"] == "make it blue"
    assert prompt[sampler["negative"][0]]["inputs"]["prompt"] == ""


def test_a_model_path_job_with_a_strength_puts_comfyuis_lora_loader_after_the_unet_loader():
    plain = prompts.shipped_prompt(plans.parse_jobs(plans.MODEL_PATH)[0], FILES, seed=1, text=None, tiny=True)
    assert "LoraLoaderModelOnly" not in {n["class_type"] for n in plain.values()}
    prompt = prompts.shipped_prompt(plans.parse_jobs(f"{plans.MODEL_PATH}:strength=0.5")[0], FILES, seed=1,
                                    text=None, tiny=True)
    (lora_id, lora), = ((k, n) for k, n in prompt.items() if n["class_type"] == "LoraLoaderModelOnly")
    unet = next(k for k, n in prompt.items() if n["class_type"] == "UNETLoader")
    assert lora["inputs"] == {"model": [unet, 0], "lora_name": "lightning4.safetensors", "strength_model": 0.5}
    readers = [n["class_type"] for n in prompt.values() if [lora_id, 0] in n["inputs"].values()]
    assert readers == ["ModelSamplingAuraFlow"]
    assert not [k for k, n in prompt.items() if k != lora_id and [unet, 0] in n["inputs"].values()]
    eight = prompts.shipped_prompt(plans.parse_jobs(f"{plans.MODEL_PATH}:lora=8")[0], FILES, seed=1, text=None,
                                   tiny=True)
    assert {"lora_name": "lightning8.safetensors", "strength_model": 1.0}.items() <= next(
        n["inputs"] for n in eight.values() if n["class_type"] == "LoraLoaderModelOnly").items()


def test_a_model_path_plan_on_fp8_files_is_refused_before_any_server(tmp_path):
    import argparse

    from fixtures_models import empty_full_size_names

    models = empty_full_size_names(tmp_path / "models")
    args = argparse.Namespace(out=tmp_path / "out", work=tmp_path / "work", deadline=None, models=models)
    with pytest.raises(SystemExit, match=r"qwen_image_edit_2509_fp8_e4m3fn\.safetensors: write the bf16 DiT"):
        pp.Run(args, "v075-model", plans.PLANS["v075-model"])
    assert not (tmp_path / "out").exists()


def test_core_prompt_follows_the_servers_inputs():
    job = plans.parse_jobs("core:compile")[0]
    old = prompts.core_prompt(job, FILES, 3, "edit", False, {"ImageScaleToTotalPixels": {"input": {"required": {}}}})
    new = prompts.core_prompt(job, FILES, 3, "edit", False,
                         {"ImageScaleToTotalPixels": {"input": {"required": {}, "optional": {"resolution_steps": []}}}})
    assert "resolution_steps" not in old["2"]["inputs"] and new["2"]["inputs"]["resolution_steps"] == 1
    assert old["13"]["class_type"] == "TorchCompileModel" and old["6"]["inputs"]["model"] == ["13", 0]
    assert old["10"]["inputs"] | {"seed": 3, "steps": 40, "cfg": 4.0, "sampler_name": "euler"} == old["10"]["inputs"]
    assert old["6"]["inputs"]["shift"] == 3.1 and old["4"]["inputs"]["type"] == "qwen_image"
    assert "13" not in prompts.core_prompt(plans.parse_jobs("core")[0], FILES, 3, "edit", False, {})


def test_the_samplers_report_and_the_server_log_are_read():
    info = "\n".join([
        "output 1024x1024", "steps: 40, cfg: 4, seed: 7", "prompt encoding: 0.41 s (cached)",
        "denoising: 12.80 s (0.320 s/step)", "VAE decode: 0.52 s", "total: 13.90 s",
        "models loaded this prompt: text encoder 3.21 s, VAE 0.35 s, DiT 7.70 s",
        "DiT built alongside the text encoder's load and the prompt's encoding: the Sampler waited 1.25 s for it "
        "after the encoding",
        "compiled: first step 28.10 s (includes any compile), graphs compiled this run: 2",
        "CUDA graphs: on (one whole-forward graph per shape)",
        "GPU memory (PyTorch's allocator): peak 26.31 GiB during this prompt, 20.02 GiB held after it"])
    assert logs.parse_stages(info) == {
        "encode_s": 0.41, "encode_cached": True, "denoise_s": 12.8, "s_per_step": 0.32, "decode_s": 0.52,
        "total_s": 13.9, "first_step_s": 28.1, "graphs_compiled": 2, "torch_peak_GiB": 26.31,
        "torch_held_GiB": 20.02, "cuda_graphs": "on (one whole-forward graph per shape)", "dit_waited_s": 1.25,
        "loads_s": {"text encoder": 3.21, "VAE": 0.35, "DiT": 7.7}}
    assert logs.parse_stages("nothing here") == {}
    log = ("got prompt\r 50%|#####     | 20/40 [00:16<00:16,  1.21it/s]\r100%|##########| 40/40 [00:33<00:00,  "
           "1.20it/s]\nPrompt executed in 35.02 seconds\n 10%|#| 1/10 [00:05<00:45,  5.00s/it]")
    parsed = logs.parse_log(log)
    assert parsed == {"progress": "1/10", "s_per_step": 5.0, "progress_elapsed_s": 5, "executed_s": 35.02}
    assert logs.parse_log(log.rsplit("\n", 1)[0])["s_per_step"] == pytest.approx(1 / 1.2, abs=1e-4)
    sampler = "INFO Qwen Edit Sampler ran from 1764312345.125 to 1764312346.063 (wall clock, s)\n"
    assert logs.parse_log(sampler + sampler.replace("45.125", "47.5"))["sampler_wall"] == [1764312347.5, 1764312346.063]


def _job(n, label, wall, held, anon, **extra):
    return {"n": n, "job": label, "series": extra.pop("series", label), "index": 0, "ok": True,
            "queue_to_image_s": wall, "stages": {"s_per_step": 0.3, **extra.pop("stages", {})},
            "gpu": {"peak_MiB": 30 * 1024, "held_MiB": held}, "host": {"peak_GiB": anon + 1, "after_GiB": anon},
            "survived": True, **extra}


def test_summary_and_table_of_a_run():
    twenty = [_job(2 + i, "fastest:vary", 14.0 + i / 10, 20480 + i, 8.0 + i / 100, series="fastest:vary*3")
              for i in range(3)]
    results = {
        "plan": "p", "description": "d", "date": "2026-11-26 10:00 UTC", "commit": "abc", "comfyui_version": "0.3.75",
        "sizes": "full", "device": "gpu", "card": {"name": "NVIDIA H100 80GB HBM3", "memory": "81559 MiB",
                                                   "driver": "580"},
        "files": {"dit": "d.safetensors", "text_encoder": "t.safetensors", "vae": "v.safetensors"},
        "servers": [{"label": "cold", "caches": "fresh", "start_s": 15.0, "idle": {"gpu_MiB": 500, "anon_GiB": 2.0},
                     "command": ["main.py", "--port", "1"], "restarts": [], "alive_at_end": True,
                     "jobs": [_job(1, "fastest", 70.0, 20480, 8.0, first_on_server=True,
                                   stages={"first_step_s": 30.0, "node_s": 66.0, "total_s": 50.0, "encode_s": 4.0,
                                           "denoise_s": 45.0, "dit_waited_s": 1.5,
                                           "loads_s": {"text encoder": 6.0, "DiT": 9.0}},
                                   around_sampler={"before_s": 3.5, "after_s": 0.3}),
                              *twenty,
                              _job(5, "lightning_4step:lora=8", 3.0, 20480, 8.0,
                                   stages={"graphs_compiled": 0, "first_step_s": 1.0}),
                              {"n": 6, "job": "low_vram", "series": "low_vram", "index": 0, "skipped": "no time"},
                              {"n": 7, "job": "core", "series": "core", "index": 0, "ok": False,
                               "error": "RuntimeError: boom\nline two", "stages": {}, "survived": True}]}],
    }
    summary = records.summarize(results)
    server = summary["servers"][0]
    assert server["first_image_s"] == 85.0 and server["anon_peak_above_idle_GiB"] == pytest.approx(7.02)
    assert (server["jobs_ok"], server["jobs_failed"], server["jobs_skipped"]) == (5, 1, 1)
    (series,) = summary["series"]
    assert series["ok"] == 3 and series["wall_median_s"] == 14.1
    assert series["gpu_held_growth_pct"] == pytest.approx(100 * 2 / 20480, abs=0.01)
    assert series["anon_growth_pct"] == pytest.approx(100 * 0.02 / 8.0, abs=0.01)
    assert summary["lora_changes"] == [{"server": "cold", "job": "lightning_4step:lora=8", "ok": True,
                                        "queue_to_image_s": 3.0, "graphs_compiled": 0, "first_step_s": 1.0}]
    again = copy.deepcopy(results)  # a second prompt with the same LoRA option is no change
    again["servers"][0]["jobs"][5:5] = [_job(5, "lightning_4step:lora=8", 1.2, 20480, 8.0),
                                        _job(5, "lightning_4step", 3.1, 20480, 8.0)]
    assert [c["job"] for c in records.summarize(again)["lora_changes"]] == ["lightning_4step:lora=8"]
    assert records.targets([again]).count("| a LoRA change: time, recompiles (none expected) |") == 1
    results["summary"] = summary
    table = records.markdown(results)
    assert "| cold | 1 | fastest | yes | 70.00 |" in table
    assert "skipped: no time" in table and "RuntimeError: boom line two" in table
    assert ("first image after **85.0 s**; where it went: before the Sampler 3.50 s, the Sampler's set-up and "
            "encoding 20.00 s (text encoder 6.00 s, DiT 9.00 s; waited 1.50 s for the DiT built beside it), first "
            "step 30.00 s, the other steps 15.00 s") in table and "NVIDIA H100 80GB HBM3" in table
    checks = records.targets([results])
    assert ("| 0.3.75 | warm fastest, queue to image <= 14.0 s (H100), each prompt a new text (its encoding "
            "included) | median 14.10 s (newest run: 2026-11-26, abc) | no |") in checks
    assert ("| 0.3.75 | GPU peak of a fastest prompt <= 28 GiB (card; PyTorch's allocator), on servers where no "
            "ComfyUI-loader prompt ran before it | 30.00 GiB; ") in checks
    assert "empty Inductor cache <= 75 s (judged on the newest run) | 85.0 s (abc) | no |" in checks
    # a row whose jobs did not run says so instead of an empty figure
    assert "| GPU peak of a low VRAM prompt <= 20 GiB (card) | not measured in these runs |  |" in checks
    assert "| a LoRA change: time, recompiles (none expected) | 3.0 s, graphs compiled 0 | yes |" in checks
    # the pack's prompts and ComfyUI core's are counted apart
    assert "| every prompt of the pack's workflows ran (failures by job) | 5 of 5 ok | yes |" in checks
    assert ("| ComfyUI core's own prompts (for comparison) | 0 of 1 ok; core on cold: RuntimeError: boom line "
            "two |") in checks
    assert "above the idle server (fastest prompts) | 7.02 GiB | yes |" in checks
    assert "the same during the pack's other workflows (low VRAM keeps DiT blocks in pinned host memory) | 7.00" \
        in checks
    # with prompts that change only the seed, the warm target is theirs, and new-text prompts get their own row
    results["servers"][0]["jobs"].append(_job(8, "fastest", 13.5, 20480, 8.0))
    checks = records.targets([results])
    assert ("| 0.3.75 | warm fastest, queue to image <= 14.0 s (H100) | median 13.50 s (newest run: 2026-11-26, abc) "
            "| yes |") in checks
    assert "| warm fastest with a new prompt text each time (its encoding included) | median 14.10 s |  |" in checks
    # the pack's memory and times are judged on the newest run that has its prompts (its build changes)
    newer = copy.deepcopy(results)
    newer.update(date="2026-11-27 10:00 UTC", commit="def")
    for job in newer["servers"][0]["jobs"]:
        if (job.get("gpu") or {}).get("peak_MiB"):
            job["gpu"]["peak_MiB"] = 20 * 1024
    checks = records.targets([results, newer])
    assert "ran before it | 20.00 GiB; " in checks and "GiB (newest run: 2026-11-27, def) | yes |" in checks
    assert "GiB (newest run: 2026-11-27, def) | yes |" not in records.targets([results])
    # the MODEL path against ComfyUI core's best warm s/step (by its progress line) and the pack's fastest
    assert "ComfyUI core nodes + FP8" not in checks
    jobs = results["servers"][0]["jobs"]
    jobs.append(_job(9, "core", 35.0, 20480, 8.0, log={"s_per_step": 0.7}))
    jobs.append(_job(10, plans.MODEL_PATH, 14.0, 20480, 8.0, log={"s_per_step": 0.32}, stages={}))
    jobs.append(_job(11, plans.MODEL_PATH, 14.0, 20480, 8.0, log={"s_per_step": 0.34}, stages={}))
    checks = records.targets([results])
    # without core's compiled step its best is not known: the ratio is shown against core eager, not judged
    assert ("| its s/step against core's warm s/step without TorchCompileModel (the target, 0.55x core's best, "
            "needs core's compiled warm step, not measured here) | 0.471x (0.330 / 0.700) |  |") in checks
    assert ("| warm fastest against core's warm prompt without TorchCompileModel (the target, 0.42x core's best, "
            "needs core's compiled warm prompt, not measured on this version) | 0.386x (13.5 s / 35.0 s) |  |"
            ) in checks
    jobs.append(_job(12, "core:compile", 30.0, 20480, 8.0, log={"s_per_step": 0.6}))
    checks = records.targets([results])
    assert "0.42x core's best warm prompt (core's workflow on the runs' fp8 or bf16 DiT file, whichever was faster) " \
           "| 0.45x (13.5 s / 30.0 s) | no |" in checks
    # core's compiled prompt from another run: the ratio says it spans two runs
    other = copy.deepcopy(results)
    other.update(commit="fed", date="2026-11-25 10:00 UTC")
    other["servers"][0]["jobs"] = [_job(1, "core:compile", 25.0, 20480, 8.0, log={"s_per_step": 0.5})]
    across = records.targets([results, other])
    assert "| 0.54x (13.5 s / 25.0 s) | no (a ratio across runs: abc / fed) |" in across
    assert "| 0.66x (0.330 / 0.500) | no (a ratio across runs: abc / fed) |" in across
    assert "| ComfyUI core nodes + FP8 (KSampler on the pack's MODEL), warm s/step | median 0.330 |  |" in checks
    assert "| its s/step <= 0.55x core's best warm s/step on the same files | 0.55x (0.330 / 0.600) | yes |" in checks
    assert "| its s/step within 10% of the pack's fastest workflow | 1.1x (0.330 / 0.300) | yes |" in checks
    # a later run's fastest prompts: the MODEL path is still held against the fastest of its own run
    newer = copy.deepcopy(results)
    newer.update(commit="new", date="2026-11-29 10:00 UTC")
    newer["servers"][0]["jobs"] = [_job(1, "fastest", 60.0, 20480, 8.0, first_on_server=True),
                                   _job(2, "fastest", 12.0, 20480, 8.0)]
    newer["servers"][0]["jobs"][1]["stages"]["s_per_step"] = 0.2
    both = records.targets([results, newer])
    assert "| its s/step within 10% of the pack's fastest workflow | 1.1x (0.330 / 0.300) | yes |" in both
    # no fastest prompt in the MODEL path's run: another run's, and the verdict says so
    alone = copy.deepcopy(results)
    alone["servers"][0]["jobs"] = [j for j in alone["servers"][0]["jobs"] if not j["job"].startswith("fastest")]
    apart = records.targets([alone, newer])
    assert "| its s/step within 10% of the pack's fastest workflow | 1.65x (0.330 / 0.200) | no (a ratio across " \
           "runs: abc / new) |" in apart
    # a LoRA strength change on the MODEL path: its prompt beside the one before it and the next at its strength
    assert "MODEL path, a LoRA strength change" not in checks
    jobs += [_job(14, f"{plans.MODEL_PATH}:strength=1", 14.1, 20480, 8.0, log={"s_per_step": 0.33}, stages={}),
             _job(15, f"{plans.MODEL_PATH}:strength=0.5", 15.2, 20480, 8.0, log={"s_per_step": 0.33}, stages={}),
             _job(16, f"{plans.MODEL_PATH}:strength=0.5", 14.2, 20480, 8.0, log={"s_per_step": 0.33}, stages={})]
    checks = records.targets([results])
    assert ("MODEL path, a LoRA strength change (comfy_model_fp8:strength=1 to comfy_model_fp8:strength=0.5)"
            ) in checks and "| 15.2 s, peak 30.00 GiB; before 14.1 s; after 14.2 s (abc) |  |" in checks
    assert checks.count("MODEL path, a LoRA strength change") == 2  # plain to strength=1, then to 0.5
    del jobs[-1]
    assert "| 15.2 s, peak 30.00 GiB; before 14.1 s; after not run (abc) |  |" in records.targets([results])
    assert "| a LoRA change: time, recompiles (none expected) | 3.0 s, graphs compiled 0 | yes |" in checks
    del jobs[-2:]
    # a fastest prompt after ComfyUI's loaders held their model on that server: its peaks are not its own
    late = _job(13, "fastest", 13.5, 46 * 1024, 60.0)
    late["gpu"]["peak_MiB"] = 50 * 1024
    jobs.append(late)
    checks = records.targets([results])
    assert "ComfyUI-loader prompt ran before it | 30.00 GiB; " in checks
    assert "above the idle server (fastest prompts) | 7.02 GiB | yes |" in checks
    assert "the same during ComfyUI core nodes + FP8 prompts (ComfyUI's loaders keep the bf16 model in host " \
           "memory) | 7.00 GiB |" in checks
    # a newer run whose fastest prompts all followed ComfyUI's loaders: the peak row keeps the older run's own
    after_core = copy.deepcopy(results)
    after_core.update(commit="cor", date="2026-11-30 10:00 UTC")
    after_core["servers"][0]["jobs"] = [_job(1, "core", 35.0, 46 * 1024, 40.0, log={"s_per_step": 0.7}),
                                        copy.deepcopy(late)]
    checks = records.targets([results, after_core])
    assert "ComfyUI-loader prompt ran before it | 30.00 GiB;  GiB (newest run: 2026-11-26, abc) | no |" in checks
    assert "queue to image <= 14.0 s (H100) | median 13.50 s (newest run: 2026-11-30, cor) | yes |" in checks


def test_a_free_job_shows_what_pytorch_still_holds_after_it():
    cuda = {"devices": [{"name": "cuda:0 NVIDIA H200 : cudaMallocAsync", "type": "cuda", "index": 0,
                         "vram_total": 150 * 2**30, "vram_free": 120 * 2**30,
                         "torch_vram_total": 28 * 2**30, "torch_vram_free": 8 * 2**30}]}
    assert records.torch_memory(cuda) == {"allocated_MiB": 20480.0, "reserved_MiB": 28672.0}
    assert records.torch_memory({"devices": [{"name": "cpu", "type": "cpu", "torch_vram_total": 1,
                                         "torch_vram_free": 1}]}) is None
    free = {"n": 2, "job": "free", "series": "free", "index": 0, "ok": True, "seconds": 3.0,
            "gpu": {"held_MiB": 28 * 1024}, "host": {"after_GiB": 5.0}, "survived": True,
            "torch_after": records.torch_memory(cuda)}
    results = {"plan": "p", "description": "d", "date": "2026-11-28 10:00 UTC", "commit": "abc",
               "comfyui_version": "0.33.0", "sizes": "full", "device": "gpu",
               "card": {"name": "NVIDIA H200", "memory": "1", "driver": "1"},
               "files": {"dit": "d", "text_encoder": "t", "vae": "v"},
               "servers": [{"label": "s", "caches": "fresh", "start_s": 15.0, "restarts": [], "alive_at_end": True,
                            "idle": {"gpu_MiB": 500, "anon_GiB": 0.5}, "jobs": [free]}]}
    results["summary"] = records.summarize(results)
    assert "| s | 2 | free | yes | 3.00 | | | | | | held 28.00 | 20.00 / 28.00 (allocated / reserved) | after 5.00 " \
           "| |" in records.markdown(results)
    free["torch_settled"] = False
    assert "| after 5.00 | allocation still falling when read |" in records.markdown(results)
    free["torch_settled"] = True
    assert "| after 5.00 | unload done (allocation steady) |" in records.markdown(results)


def test_a_free_job_waits_until_the_allocation_stops_falling():
    def run(values, rounds=20):
        reads, slept, left = iter(values), [], [rounds]

        def keep_waiting():
            left[0] -= 1
            return left[0] >= 0

        return sampling.wait_steady(lambda: next(reads), keep_waiting, sleep=slept.append), len(slept)

    falling = [28000.0, 24000.0, 20000.0, 16000.0, 12000.0, 9000.0, 9005.0, 9004.0, 9006.0, 9006.0, 9006.0]
    assert run(falling) == (True, 9)  # steady only after four reads within 16 MiB of the one before
    assert run([28000.0 - 1000 * i for i in range(30)], rounds=10) == (False, 10)
    assert run([None]) == (None, 0)


def test_each_twenty_prompt_series_row_names_its_run():
    def run(commit, date, held_growth):
        jobs = [_job(1 + i, "fastest:vary", 14.0, 20480 + (held_growth if i == 19 else 0), 8.0,
                     series="fastest:vary*20", first_on_server=i == 0) for i in range(20)]
        return {"plan": "p", "description": "d", "date": date, "commit": commit, "comfyui_version": "0.3.75",
                "sizes": "full", "device": "gpu", "card": {"name": "NVIDIA H200", "memory": "1", "driver": "1"},
                "files": {"dit": "d", "text_encoder": "t", "vae": "v"},
                "servers": [{"label": "twenty", "caches": "fresh", "start_s": 15.0, "restarts": [],
                             "idle": {"gpu_MiB": 500, "anon_GiB": 0.5}, "alive_at_end": True, "jobs": jobs}]}

    checks = records.targets([run("bbb2222", "2026-11-28 10:00 UTC", 1024), run("aaa1111", "2026-11-27 10:00 UTC", 0)])
    rows = [line for line in checks.splitlines() if "20 prompts" in line or "20 fastest prompts" in line]
    assert rows == [
        "| 0.3.75 | 20 fastest prompts in a row, new seeds and prompts: nothing lost, no crash | 20 of 20 ok, server "
        "survived each: yes (2026-11-27, aaa1111) | yes |",
        "| 0.3.75 | 20 fastest prompts in a row, new seeds and prompts: nothing lost, no crash | 20 of 20 ok, server "
        "survived each: yes (2026-11-28, bbb2222) | yes |",
        "| 0.3.75 | growth over 20 prompts <= 2% (GPU held; host anonymous) | 0.00%; 0.00% (2026-11-27, aaa1111) "
        "| yes |",
        "| 0.3.75 | growth over 20 prompts <= 2% (GPU held; host anonymous) | 5.00%; 0.00% (2026-11-28, bbb2222) "
        "| no |",
    ], rows


def test_record_rewrites_the_cards_product_path_file(tmp_path):
    results = {"plan": "p", "description": "d", "date": "2026-11-26 10:00 UTC", "commit": "abc",
               "comfyui_version": "0.33.0", "sizes": "full", "device": "gpu",
               "card": {"name": "NVIDIA H200", "memory": "143771 MiB", "driver": "580.159.04"},
               "files": {"dit": "d", "text_encoder": "t", "vae": "v"}, "servers": []}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    folder = tmp_path / "performance"
    first = records.write_record([path], folder)
    second = records.write_record([path], folder)
    text = second.read_text()
    assert first == second == folder / "H200-product-path.md"
    assert text.startswith("# Product path on H200") and text.count("\n# ") == 0 and "ComfyUI 0.33.0" in text
    assert "Commit: abc" in text and "GPU: NVIDIA H200" in text


FAKE_SMI = '''#!{python}
"""nvidia-smi's two queries the tool makes, from a file holding the MiB 'used' (a stand-in for the card)."""
import sys, time, datetime
args = " ".join(sys.argv[1:])
if "name,memory.total" in args:
    print("Fake GPU 80GB, 81559 MiB, 580.00")
    sys.exit(0)
period = int(sys.argv[sys.argv.index("-lms") + 1]) / 1000
while True:
    stamp = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    print(f"{{stamp}}, {{open('{used}').read().strip()}}", flush=True)
    time.sleep(period)
'''


def test_memory_sampler_windows_the_cards_samples_and_the_process_memory(tmp_path, monkeypatch):
    import os
    import time

    used = tmp_path / "used"
    used.write_text("100")
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(FAKE_SMI.format(python=sys.executable, used=used))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    assert pp.card() == {"name": "Fake GPU 80GB", "memory": "81559 MiB", "driver": "580.00"}
    sampler = sampling.MemorySampler(gpu=True)
    sampler.pid = os.getpid()
    try:
        sampler.settle(time.time() + 0.3, timeout=20)  # the stand-in is running and has sampled
        t0 = time.time()
        used.write_text("5000")
        time.sleep(0.8)
        used.write_text("2000")
        time.sleep(0.8)
        t1 = time.time()
        time.sleep(0.6)
        after = time.time()
        sampler.settle(after)
        window = sampler.gpu_window(t0, t1, after)
        assert window == {"before_MiB": 100.0, "peak_MiB": 5000.0, "held_MiB": 2000.0}
        host = sampler.anon_window(t0, t1, after)
        assert 0 < host["after_GiB"] <= host["tree_peak_GiB"] and host["peak_GiB"] > 0
    finally:
        sampler.stop()


def test_kept_caches_outlive_the_run_and_their_first_image_is_no_start_row(tmp_path):
    from types import SimpleNamespace

    spec = plans.ServerSpec("model", "core:compile")
    kept = SimpleNamespace(args=SimpleNamespace(keep_caches=True), work=tmp_path)
    record: dict = {}
    folder = pp.Run.cache_dirs(kept, spec, 0, record)
    assert folder == tmp_path / pp.KEPT_CACHES and record == {"caches": "kept", "kept_cache_files": 0}
    (folder / "inductor").mkdir()
    (folder / "inductor" / "graph.bin").write_text("compiled")
    record = {}
    assert pp.Run.cache_dirs(kept, spec, 1, record) == folder  # a later run, or the next server: the same folder
    assert record["kept_cache_files"] == 1 and (folder / "inductor" / "graph.bin").is_file()
    fresh = SimpleNamespace(args=SimpleNamespace(keep_caches=False), work=tmp_path)
    record = {}
    (tmp_path / "cache-0").mkdir()
    (tmp_path / "cache-0" / "old.bin").write_text("x")
    assert pp.Run.cache_dirs(fresh, spec, 0, record) == tmp_path / "cache-0" and record == {}
    assert not any((tmp_path / "cache-0").iterdir())  # without the option every fresh server starts empty

    def run(caches):
        job = {"n": 1, "job": "fastest", "series": "fastest", "index": 0, "ok": True, "queue_to_image_s": 30.0,
               "stages": {"s_per_step": 0.3}, "gpu": {"peak_MiB": 20480, "held_MiB": 19000},
               "host": {"peak_GiB": 9.0, "after_GiB": 9.0}, "survived": True, "first_on_server": True}
        return {"plan": "p", "description": "d", "date": "2026-11-28 10:00 UTC", "commit": "abc",
                "comfyui_version": "0.3.75", "sizes": "full", "device": "gpu",
                "card": {"name": "NVIDIA H200", "memory": "143771 MiB", "driver": "580"},
                "files": {"dit": "d", "text_encoder": "t", "vae": "v"},
                "servers": [{"label": "model", "caches": caches, "start_s": 20.0, "kept_cache_files": 7,
                             "idle": {"gpu_MiB": 500, "anon_GiB": 0.5}, "restarts": [], "alive_at_end": True,
                             "jobs": [job]}]}

    assert "empty Inductor cache <= 75 s" in records.targets([run("fresh")])
    kept_run = run("kept")
    assert "Inductor cache <=" not in records.targets([kept_run])
    assert "(Inductor/Triton caches kept, 7 files at its start from earlier runs)" in records.markdown(kept_run)
    kept_run["servers"][0]["env"] = {"TORCHINDUCTOR_CACHE_DIR": "i", "TRITON_CACHE_DIR": "t", "CUDA_CACHE_PATH": "c"}
    assert "(Inductor/Triton/CUDA JIT caches kept, 7 files" in records.markdown(kept_run)
