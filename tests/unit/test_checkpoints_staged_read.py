"""The staged reader (qwen_edit/checkpoints/staged_read.py) gives exactly safetensors' own tensors, with the same
checks, and leaves nothing behind when stopped early.

Every floating dtype the weights use, 0-d and empty tensors, tensors split over many reader threads in small
chunks, groups over two files; a file that shrank after its header was checked, a NaN, an integer tensor; a reader
closed after its first group.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from qwen_edit_hopper.qwen_edit.checkpoints.errors import CheckpointError
from qwen_edit_hopper.qwen_edit.checkpoints.safetensors_io import load_tensors, read_header
from qwen_edit_hopper.qwen_edit.checkpoints.staged_read import data_start, group_bytes, read_groups, spans_of
from safetensors.torch import save_file


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(37, 53, generator=g)
    return {
        "a.bf16": base.to(torch.bfloat16),
        "a.f32": torch.randn(301, generator=g),
        "a.f16": torch.randn(5, 7, 3, generator=g).half(),
        "b.e4m3": (base * 4).to(torch.float8_e4m3fn),
        "b.e5m2": (base * 4).to(torch.float8_e5m2),
        "b.scalar": torch.tensor(0.25),
        "b.empty": torch.empty(0, 16),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.fixture
def two_files(tmp_path):
    paths = []
    for index in range(2):
        path = tmp_path / f"part{index}.safetensors"
        save_file(_tensors(index), str(path))
        paths.append(path)
    return paths


def _groups(paths, prefixes=("a.", "b.")):
    """Per prefix, the spans of both files' tensors with that prefix (renamed with the file's index)."""
    headers = [read_header(path) for path in paths]
    return [[span for index, header in enumerate(headers)
             for span in spans_of(header, {key: f"{index}/{key}" for key in header.tensors if key.startswith(p)})]
            for p in prefixes]


@pytest.mark.parametrize("threads,chunk_bytes", [(1, 1 << 20), (4, 64), (8, 1000)])
def test_groups_equal_what_safetensors_reads(two_files, threads, chunk_bytes):
    expected = {f"{index}/{key}": tensor for index, path in enumerate(two_files)
                for key, tensor in load_tensors(path).items()}
    got = list(read_groups(_groups(two_files), device="cpu", threads=threads, chunk_bytes=chunk_bytes))
    assert [sorted(group) for group in got] == [sorted(k for k in expected if k.split("/")[1].startswith(p))
                                                for p in ("a.", "b.")]
    for group in got:
        for name, tensor in group.items():
            assert _same(tensor, expected[name]), name
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name


def test_the_data_block_starts_after_the_header(two_files):
    header = read_header(two_files[0])
    with open(two_files[0], "rb") as handle:
        assert data_start(header) == 8 + int.from_bytes(handle.read(8), "little")
    spans = _groups(two_files[:1])[0]
    assert group_bytes(spans) >= sum(span.info.nbytes for span in spans)


def test_a_file_that_shrank_after_its_header_was_read_is_named(two_files):
    groups = _groups(two_files)
    os.truncate(two_files[1], os.path.getsize(two_files[1]) - 100)
    with pytest.raises(CheckpointError) as raised:
        list(read_groups(groups, device="cpu"))
    assert "part1.safetensors" in str(raised.value) and "truncated" in str(raised.value)


def test_a_nan_is_refused_naming_the_file_and_tensor(tmp_path):
    path = tmp_path / "nan.safetensors"
    tensors = _tensors(3)
    tensors["a.bf16"][2, 3] = float("nan")
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError) as raised:
        list(read_groups(_groups([path]), device="cpu"))
    assert "nan.safetensors" in str(raised.value) and "a.bf16" in str(raised.value)


def test_an_integer_tensor_is_refused_before_any_read(tmp_path):
    path = tmp_path / "ints.safetensors"
    save_file({"a.ids": torch.arange(10), "b.w": torch.ones(3)}, str(path))
    reads = read_groups(_groups([path]), device="cpu")
    os.truncate(path, 0)  # a read would fail differently: the dtype check comes first
    with pytest.raises(CheckpointError, match="integer or boolean"):
        next(reads)


def test_closing_early_joins_the_readers_and_closes_the_files(two_files):
    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    def readers():
        return [t for t in threading.enumerate() if t.name.startswith("qwen-edit-read")]

    before = open_fds()
    reads = read_groups(_groups(two_files), device="cpu", threads=3, chunk_bytes=64)
    first = next(reads)
    assert first and readers()
    reads.close()
    assert not readers()
    assert open_fds() == before


@pytest.mark.parametrize("threads,chunk_bytes", [(0, 1), (1, 0)])
def test_bad_reader_shapes_are_refused(two_files, threads, chunk_bytes):
    with pytest.raises(ValueError, match="threads and chunk_bytes"):
        next(read_groups(_groups(two_files), device="cpu", threads=threads, chunk_bytes=chunk_bytes))
