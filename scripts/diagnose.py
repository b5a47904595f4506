"""Print this machine's FP8 / attention diagnosis and the preset to use (fp8.diagnose).

Run it with the Python that runs ComfyUI:
    python custom_nodes/qwen-edit-hopper/scripts/diagnose.py
It never fails on a missing optional package (Transformer Engine, flash-attn): it reports it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pack import load_pack


def main() -> int:
    load_pack()
    from qwen_edit_hopper.fp8 import diagnose

    print(diagnose().to_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
