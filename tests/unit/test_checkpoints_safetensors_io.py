"""safetensors headers are validated without reading tensors; pickles are refused."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from qwen_edit_hopper.qwen_edit.checkpoints import CheckpointError, check_suffix, load_tensors, read_header
from safetensors.torch import save_file


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.safetensors"
    save_file(
        {
            "a.weight": torch.ones(2, 3, dtype=torch.bfloat16),
            "b": torch.zeros(4),
            "m": torch.empty(0, dtype=torch.float8_e4m3fn),
        },
        str(path),
        metadata={"modelspec.title": "x"},
    )
    return path


def _write_raw(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_header_is_read_without_tensors(good):
    header = read_header(good)
    assert header.keys == {"a.weight", "b", "m"}
    assert header.tensors["a.weight"].dtype == "BF16"
    assert header.tensors["a.weight"].shape == (2, 3)
    assert header.tensors["m"].numel == 0
    assert header.metadata == {"modelspec.title": "x"}
    assert header.file_size == good.stat().st_size


def test_load_tensors_uses_safe_open(good):
    tensors = load_tensors(good, keys=["a.weight"])
    assert list(tensors) == ["a.weight"]
    assert tensors["a.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".pth", ".bin"])
def test_pickles_are_refused_with_the_reason(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    message = str(info.value)
    assert path.name in message
    assert "pickle" in message and "run arbitrary code" in message
    assert "Convert it to .safetensors" in message


def test_other_suffixes_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"only \.safetensors files are loaded"):
        check_suffix(tmp_path / "model.gguf")


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_header(tmp_path / "nope.safetensors")


def test_truncated_file_names_file_and_sizes(good, tmp_path):
    cut = tmp_path / "cut.safetensors"
    data = good.read_bytes()
    cut.write_bytes(data[:-5])
    with pytest.raises(CheckpointError) as info:
        read_header(cut)
    message = str(info.value)
    assert message.startswith("cut.safetensors is truncated")
    assert "Download or copy the file again" in message


def test_file_shorter_than_length_prefix(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="is truncated: only 2 bytes"):
        read_header(path)


def test_header_length_beyond_file(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(CheckpointError, match="corrupted header: it claims 10000 header bytes"):
        read_header(path)


def test_corrupted_json(good, tmp_path):
    data = bytearray(good.read_bytes())
    data[9] = ord("#")  # inside the JSON
    path = tmp_path / "json.safetensors"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted header: its JSON does not parse"):
        read_header(path)


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ({"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}, "unknown dtype"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "invalid shape"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [4, 0]}, "invalid data_offsets"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "needs 8"),
        ("nonsense", "not described by a JSON object"),
    ],
)
def test_bad_tensor_entries(tmp_path, entry, why):
    path = tmp_path / "entry.safetensors"
    _write_raw(path, {"t": entry}, b"\x00" * 4)
    with pytest.raises(CheckpointError, match=why):
        read_header(path)


def test_overlapping_tensors(tmp_path):
    path = tmp_path / "overlap.safetensors"
    entry = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    _write_raw(path, {"a": entry, "b": entry}, b"\x00" * 4)
    with pytest.raises(CheckpointError, match="overlaps"):
        read_header(path)


def test_trailing_garbage(good, tmp_path):
    path = tmp_path / "extra.safetensors"
    path.write_bytes(good.read_bytes() + b"junk")
    with pytest.raises(CheckpointError, match="4 unexpected bytes follow the last tensor"):
        read_header(path)


def test_error_is_a_value_error_with_fields(tmp_path):
    with pytest.raises(ValueError) as info:
        read_header(tmp_path / "x.pt")
    error = info.value
    assert isinstance(error, CheckpointError)
    assert error.path.name == "x.pt" and error.problem and error.remedy
    assert str(tmp_path) in str(error)
