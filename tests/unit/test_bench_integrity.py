"""The load-time check's cost (``bench/product_path.py integrity``) on the CPU: both reads agree, the record
has every figure (the GPU run is the real one)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from productpath import integrity
from test_checkpoints_support import tiny


def test_synthetic_file_measures(tmp_path):
    path = integrity.write_synthetic_dit(tmp_path / "dit.safetensors", blocks=1, dim=128)
    plain = integrity.plain_read([path], torch.device("cpu"))
    checked = integrity.checked_read([path], torch.device("cpu"))
    assert plain.keys() == checked.keys() and all(torch.equal(plain[k], checked[k]) for k in plain)
    record = integrity.measure_integrity([path], "cpu", repeats=1)
    assert record["tensors"] == len(plain) and record["check_alone_s"] > 0
    assert "of the checked load" in integrity.integrity_report(record)


def test_a_damaged_file_is_not_measured(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "bad.safetensors"
    save_file({"w": torch.tensor([1.0, float("nan")])}, str(path))
    with pytest.raises(ValueError, match="NaN or Inf"):
        integrity.measure_integrity([path], "cpu", repeats=1)


def test_model_files_measure(tmp_path_factory):
    files = tiny("comfy_single", "edit_2509", tmp_path_factory)
    record = integrity.measure_model_loads(files["dit"][0], files["text_encoder"][0], files["vae"][0], "cpu",
                                           repeats=1)
    assert record["model_load_s"] > 0 and record["check_share_of_load"] > 0
