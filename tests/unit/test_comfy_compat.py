"""nodes/comfy_compat.py: the combo check, and the ComfyUI version the diagnosis names."""

from __future__ import annotations

from pathlib import Path

from qwen_edit_hopper.nodes.comfy_compat import TESTED_VERSIONS, check_choices, comfyui_version, diagnosis_lines

ROOT = Path(__file__).resolve().parents[2]


def test_check_choices_names_the_input_and_the_options():
    assert check_choices(mode=("default", ["default", "max-autotune"])) is None
    problem = check_choices(mode=("fast", ["default", "max-autotune"]))
    assert problem == "mode 'fast' is not one of default, max-autotune"


def test_version_read_from_a_comfyui_folder(tmp_path):
    (tmp_path / "comfyui_version.py").write_text('# generated\n__version__ = "0.40.1"\n')
    assert comfyui_version(tmp_path) == ("0.40.1", str(tmp_path / "comfyui_version.py"))
    version, why = comfyui_version(tmp_path / "nowhere")
    assert version is None and "not a ComfyUI folder" in why


def test_diagnosis_says_whether_the_version_is_tested(tmp_path):
    (tmp_path / "comfyui_version.py").write_text('__version__ = "0.40.1"\n')
    (line,) = diagnosis_lines(tmp_path)
    assert (line.name, line.value) == ("ComfyUI", "0.40.1")
    assert "not a version this pack is tested on (0.3.75, 0.33.0)" in line.reason
    (tmp_path / "comfyui_version.py").write_text(f'__version__ = "{TESTED_VERSIONS[-1]}"\n')
    assert diagnosis_lines(tmp_path)[0].reason.endswith("tested with this pack")
    assert diagnosis_lines(tmp_path / "nowhere")[0].value == "not found"


def test_the_test_environments_comfyuis_are_the_tested_versions():
    """The versions the tests start (scripts/comfy_server.py) are the ones the pack says it is tested on."""
    from comfy_server import COMFYUI_VERSIONS

    assert tuple(COMFYUI_VERSIONS) == TESTED_VERSIONS
    for version, install in COMFYUI_VERSIONS.items():
        if install.missing() is None:
            assert comfyui_version(install.directory)[0] == version
