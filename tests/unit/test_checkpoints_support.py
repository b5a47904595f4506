"""Shared helpers for the checkpoint tests (this module holds no tests).

* :func:`tiny` writes tiny checkpoints once per (layout, variant) per test run;
* :func:`comfy` imports ComfyUI's modules (``QWEN_EDIT_COMFYUI_DIR``, default
  ``.testenv/comfyui``) for building its real classes on ``meta``;
* :func:`keys_and_shapes` lists a module's state-dict without allocating.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
COMFYUI_DIR = Path(os.environ.get("QWEN_EDIT_COMFYUI_DIR", ROOT / ".testenv" / "comfyui"))
COMFY_TOKENIZER_DIR = COMFYUI_DIR / "comfy" / "text_encoders" / "qwen25_tokenizer"

_TINY: dict[tuple[str, str], dict[str, Any]] = {}


def tiny(layout: str, variant: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Tiny checkpoints of ``layout`` / ``variant``, written once per test run. Treat as read-only."""
    from qwen_edit_hopper.qwen_edit.tiny import write_tiny_checkpoints

    if not COMFY_TOKENIZER_DIR.is_dir():
        pytest.skip(f"ComfyUI tokenizer files not found at {COMFY_TOKENIZER_DIR} (set QWEN_EDIT_COMFYUI_DIR)")
    key = (layout, variant)
    if key not in _TINY:
        root = tmp_path_factory.mktemp(f"tiny_{layout}_{variant}")
        _TINY[key] = write_tiny_checkpoints(root, layout, comfy_tokenizer_dir=COMFY_TOKENIZER_DIR, variant=variant)
    return _TINY[key]


def comfy() -> SimpleNamespace:
    """ComfyUI 0.3.75's ``ops``, ``text_encoders.llama`` and ``ldm.wan.vae`` (CPU mode when there is no GPU)."""
    if not (COMFYUI_DIR / "comfy").is_dir():
        pytest.skip(f"ComfyUI not found at {COMFYUI_DIR} (set QWEN_EDIT_COMFYUI_DIR)")
    if str(COMFYUI_DIR) not in sys.path:
        sys.path.insert(0, str(COMFYUI_DIR))
    import comfy.cli_args

    if not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True
    import comfy.ldm.wan.vae
    import comfy.ops
    import comfy.text_encoders.llama

    return SimpleNamespace(ops=comfy.ops, llama=comfy.text_encoders.llama, wan_vae=comfy.ldm.wan.vae)


def keys_and_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """State-dict name -> shape (works on ``meta`` modules)."""
    return {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}


def file_shapes(paths) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over the headers of ``paths`` (no tensor read)."""
    from qwen_edit_hopper.qwen_edit.checkpoints import read_header

    out: dict[str, tuple[int, ...]] = {}
    for path in paths if isinstance(paths, (list, tuple)) else [paths]:
        out.update(read_header(path).shapes())
    return out


def assert_same_structure(real: dict[str, tuple[int, ...]], tiny_: dict[str, tuple[int, ...]]) -> None:
    """Equal key sets, and every tensor has the same number of dimensions."""
    assert set(real) == set(tiny_), (
        f"only in real: {sorted(set(real) - set(tiny_))[:5]}, only in tiny: {sorted(set(tiny_) - set(real))[:5]}"
    )
    wrong = {k: (real[k], tiny_[k]) for k in real if len(real[k]) != len(tiny_[k])}
    assert not wrong, f"ndim differs: {list(wrong.items())[:5]}"


def truncate(module_list: torch.nn.ModuleList, count: int) -> torch.nn.ModuleList:
    """The first ``count`` modules of a ModuleList (the real classes, fewer layers)."""
    return torch.nn.ModuleList(list(module_list)[:count])
