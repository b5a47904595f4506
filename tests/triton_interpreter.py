"""Run a probe under Triton's CPU interpreter (``TRITON_INTERPRET=1``) in a subprocess; return its JSON line.

The interpreter must be switched on before Triton is imported, hence the subprocess. The probe's
preamble loads the pack as ``qwen_edit_hopper`` and patches two interpreter issues: numpy >= 2.4
refuses ``int()`` on 1-element arrays, which Triton 3.6's interpreter does for ``range()`` /
``tl.range`` bounds; and ``torch.library.wrap_triton`` rejects the interpreter's function objects
(``WRAP_TRITON_MODULES`` lists the pack modules whose ``wrap_triton`` is replaced by the identity).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PREAMBLE = """
import importlib, sys
import numpy as np
from triton.runtime import interpreter as _ti
_orig = _ti._patch_lang_tensor
def _patched(tensor, scope):
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
_ti._patch_lang_tensor = _patched
sys.path.insert(0, {scripts!r})
from pack import load_pack
load_pack()
for _name in {wrap_modules!r}:
    importlib.import_module(_name).wrap_triton = lambda kernel: kernel
"""


def run_probe(code: str, wrap_triton_modules: tuple[str, ...] = (), timeout: int = 600):
    """Run ``code`` (which prints one JSON line last) under the interpreter; returns the parsed line."""
    preamble = _PREAMBLE.format(scripts=str(ROOT / "scripts"), wrap_modules=list(wrap_triton_modules))
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", preamble + code], capture_output=True, text=True,
                            timeout=timeout, env=env, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
