"""The pack imports cheaply and safely outside ComfyUI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys, time
sys.path.insert(0, {scripts!r})
started = time.perf_counter()
from pack import load_pack
pack = load_pack()
elapsed = time.perf_counter() - started
heavy = [m for m in ("comfy", "comfy_api", "diffsynth", "transformer_engine", "flash_attn", "transformers", "torch")
         if m in sys.modules]
public = [n for n in dir(pack) if not n.startswith("_")]
print(json.dumps({{"heavy": heavy, "public": public, "elapsed": elapsed,
                  "entrypoint": callable(getattr(pack, "comfy_entrypoint", None)),
                  "has_v1": hasattr(pack, "NODE_CLASS_MAPPINGS")}}))
"""


def test_package_imports_without_comfyui_and_without_heavy_modules():
    """Importing the pack needs no ComfyUI and pulls in no torch, DiffSynth, TE or flash-attn."""
    code = PROBE.format(scripts=str(ROOT / "scripts"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["heavy"] == [], f"importing the pack imported {info['heavy']}"
    assert info["entrypoint"], "comfy_entrypoint must be exported"
    assert not info["has_v1"], "NODE_CLASS_MAPPINGS would make ComfyUI ignore comfy_entrypoint"
    assert info["public"] == ["comfy_entrypoint"]
