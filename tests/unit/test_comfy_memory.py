"""The pack's models in ComfyUI's memory manager, in process: ComfyUI's unload (``/free``) of one never raises.

ComfyUI runs ``/free``'s unload in its prompt worker thread, outside any ``try``: an exception there ends the
worker, and no prompt runs after it while the server still answers.
"""

from __future__ import annotations

import logging

import torch
from test_checkpoints_support import comfy as import_comfy


class _Unmovable(torch.nn.Linear):
    """A layer whose tensors cannot be moved (as a tensor subclass without a ``meta`` kernel)."""

    def _apply(self, fn, recurse=True):
        raise RuntimeError("no meta kernel for this tensor")


def test_an_unload_whose_tensors_cannot_move_lets_go_of_the_model_and_does_not_raise(caplog):
    import_comfy()
    import comfy.model_management as mm
    from qwen_edit_hopper.nodes.comfy_memory import ComfyHooks
    from qwen_edit_hopper.qwen_edit.runtime import PlanRuntime

    hooks = ComfyHooks()
    runtime = PlanRuntime("cpu", torch.float32, hooks=hooks)
    hooks.runtime = runtime
    resident = runtime.adopt(("dit", "files", None, 0), _Unmovable(2, 2), "DiT")
    runtime.use([resident])
    assert any(loaded.model is resident.handle for loaded in mm.current_loaded_models)

    with caplog.at_level(logging.WARNING):
        mm.unload_all_models()  # what /free runs

    assert runtime.residents() == []
    assert not any(loaded.model is resident.handle for loaded in mm.current_loaded_models)
    assert "DiT: its tensors could not be dropped at once (RuntimeError: no meta kernel" in caplog.text
