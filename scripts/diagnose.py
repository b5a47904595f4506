"""Print this machine's FP8 / attention diagnosis, the ComfyUI it serves, and the preset to use (fp8.diagnose).

Run it with the Python that runs ComfyUI:
    python custom_nodes/qwen-edit-hopper/scripts/diagnose.py
It names the ComfyUI version it finds (the folder that holds this pack's custom_nodes folder, else the current
folder, else ``--comfyui``) and whether this pack is tested on it. It never fails on a missing optional package
(Transformer Engine, flash-attn): it reports it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pack import ROOT, load_pack


def find_comfyui(given: Path | None) -> Path | None:
    """``given``, else the ComfyUI folder this pack is installed in (``<ComfyUI>/custom_nodes/<pack>``), else the
    current folder when it is a ComfyUI folder; None when none is."""
    if given is not None:
        return given
    for candidate in (Path(sys.argv[0]).absolute().parents[3], ROOT.parent.parent, Path.cwd()):
        if (candidate / "comfyui_version.py").is_file():
            return candidate
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", type=Path, help="the ComfyUI folder (the one holding main.py), if not found")
    args = parser.parse_args()
    load_pack()
    from qwen_edit_hopper.fp8 import diagnose
    from qwen_edit_hopper.nodes.comfy_compat import diagnosis_lines

    comfyui = find_comfyui(args.comfyui)
    if comfyui is None:
        from qwen_edit_hopper.fp8.diagnose import DiagnosticLine

        host = [DiagnosticLine("ComfyUI", "not found", "no comfyui_version.py in the folder above custom_nodes or "
                               "the current folder: pass --comfyui <ComfyUI folder>")]
    else:
        host = diagnosis_lines(comfyui)
    print(diagnose(host_lines=host).to_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
