"""Import this checkout as the package ``qwen_edit_hopper`` from any script.

ComfyUI imports the pack under its folder path; scripts, tests and the GPU
benchmark import it under one fixed name so their imports read the same
wherever the checkout lives.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACKAGE_NAME = "qwen_edit_hopper"
ROOT = Path(__file__).resolve().parents[1]


def load_pack() -> ModuleType:
    """Register the checkout as ``qwen_edit_hopper`` in ``sys.modules`` and return it."""
    if PACKAGE_NAME in sys.modules:
        return sys.modules[PACKAGE_NAME]
    spec = importlib.util.spec_from_file_location(
        PACKAGE_NAME, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE_NAME] = module
    spec.loader.exec_module(module)
    return module
