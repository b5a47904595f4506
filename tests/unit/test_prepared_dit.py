"""What the fast forward keeps for a model lives in its PreparedDit (qwen_edit/fast/prepared.py), on CPU.

``invalidate`` drops the CUDA graphs, modulation groups, kernel plans and caches; two models share nothing; no
process-wide ``nn.Module`` registration hook is installed, even with CUDA graphs on; the runtime makes one for each
built DiT and a new one for a rebuilt model.
"""

from __future__ import annotations

import torch
from qwen_edit_hopper.qwen_edit.checkpoints import resolve_single_files
from qwen_edit_hopper.qwen_edit.fast import prepared as prepared_module
from qwen_edit_hopper.qwen_edit.fast.prepared import PreparedDit
from qwen_edit_hopper.qwen_edit.fast_forward import fast_model_fn, kernel_plan
from qwen_edit_hopper.qwen_edit.plan import CompileChoice, PipePlan, Variant
from qwen_edit_hopper.qwen_edit.runtime import PlanRuntime, dit_key
from test_checkpoints_support import tiny
from test_fast_forward import build_dit, make_inputs

HOOK_REGISTRIES = ("_global_parameter_registration_hooks", "_global_buffer_registration_hooks",
                   "_global_module_registration_hooks")


def _hooks() -> dict[str, int]:
    module = torch.nn.modules.module
    return {name: len(getattr(module, name)) for name in HOOK_REGISTRIES}


def test_invalidate_drops_graphs_groups_plans_and_caches(monkeypatch):
    made = []
    monkeypatch.setattr(prepared_module, "modulation_groups", lambda dit: made.append(object()) or made[-1])
    dit = build_dit(torch.float32, layers=2)
    prepared = PreparedDit(dit)
    graphs = prepared.enable_cuda_graphs()
    groups = prepared.modulation_groups()
    assert prepared.modulation_groups() is groups and len(made) == 1  # kept
    x = make_inputs()
    plan = kernel_plan(prepared, **x)
    tables = prepared.rope_tables([(1, 8, 8)], 13, torch.device("cpu"))
    prepared.invalidate()
    assert prepared.graphs is not graphs and len(prepared.graphs) == 0  # still on, nothing captured
    assert prepared.modulation_groups() is not groups and len(made) == 2
    assert kernel_plan(prepared, **x) is not plan and prepared.last_plan is not plan
    assert prepared.rope_tables([(1, 8, 8)], 13, torch.device("cpu")) is not tables
    assert prepared.compiled is None  # the compile choice is not structure: it stays what it was
    prepared.compile_blocks(backend="eager")
    prepared.invalidate()
    assert prepared.compiled is not None


def test_two_models_share_nothing():
    one, two = PreparedDit(build_dit(torch.float32, layers=2)), PreparedDit(build_dit(torch.float32, layers=2))
    one.compile_blocks(backend="eager")
    one.enable_cuda_graphs()
    assert two.compiled is None and two.graphs is None
    x = make_inputs()
    assert kernel_plan(one, **x) is not kernel_plan(two, **x)
    assert (one.rope_tables([(1, 8, 8)], 13, torch.device("cpu"))
            is not two.rope_tables([(1, 8, 8)], 13, torch.device("cpu")))
    assert one.target_selector(64, 100, torch.device("cpu")) is one.target_selector(64, 100, torch.device("cpu"))


def test_no_process_wide_registration_hooks():
    before = _hooks()
    prepared = PreparedDit(build_dit(torch.float32, layers=2))
    prepared.enable_cuda_graphs()
    fast_model_fn(prepared, **make_inputs())
    torch.nn.Linear(4, 4)  # a module built elsewhere afterwards
    assert _hooks() == before == dict.fromkeys(HOOK_REGISTRIES, 0)


def test_the_runtime_prepares_each_built_dit_and_a_rebuilt_one_anew(tmp_path_factory):
    files = tiny("comfy_single", "edit_2509", tmp_path_factory)
    plan = PipePlan(files=resolve_single_files(files["dit"][0], files["text_encoder"][0], files["vae"][0]),
                    variant=Variant.EDIT_2509, variant_reason="test")
    runtime = PlanRuntime("cpu", torch.float32)
    dit = runtime.dit(plan)
    prepared = dit.prepared
    assert isinstance(prepared, PreparedDit) and prepared.module is dit.module and prepared.compiled is None
    compiled = runtime.dit(plan.with_compile(CompileChoice()))
    assert compiled is dit and compiled.prepared is prepared and prepared.compiled is not None  # same model
    assert runtime.dit(plan).prepared.compiled is None
    runtime.evict(dit_key(plan))
    assert dit.prepared is None and dit.module is None
    rebuilt = runtime.dit(plan)
    assert rebuilt.prepared is not prepared and rebuilt.prepared.module is rebuilt.module
