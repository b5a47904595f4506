"""Shared pytest setup: the checkout is importable as ``qwen_edit_hopper``.

Server, checkpoint and browser fixtures live in their own modules
(tests/fixtures_*.py) and are registered below as plugins.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from pack import load_pack  # noqa: E402

load_pack()

pytest_plugins = ["fixtures_server"]
