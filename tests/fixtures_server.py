"""Pytest fixtures: a real ComfyUI server with this pack, and its log on failure."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from comfy_server import ComfyServer

SERVERS: list[ComfyServer] = []
NETGUARD_DIR = Path(__file__).resolve().parent / "netguard"


@contextlib.contextmanager
def running(server: ComfyServer) -> Iterator[ComfyServer]:
    """Start ``server``, list it in SERVERS (its log is printed on a failure) for the block, then stop it."""
    server.start()
    SERVERS.append(server)
    try:
        yield server
    finally:
        server.stop()
        SERVERS.remove(server)


def guarded_server(base: Path) -> ComfyServer:
    """A server whose Python refuses and logs every non-loopback connection (base/netguard.log)."""
    pythonpath = os.pathsep.join(p for p in (str(NETGUARD_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return ComfyServer(base, env={"PYTHONPATH": pythonpath, "QWEN_EDIT_NETGUARD_LOG": str(base / "netguard.log")})


@pytest.fixture(scope="session")
def comfy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    """One ComfyUI server for the session, with the tiny checkpoints in its model folders."""
    from fixtures_models import install_tiny_models

    base = tmp_path_factory.mktemp("comfy")
    install_tiny_models(base / "models")
    with running(guarded_server(base)) as server:
        yield server


@pytest.fixture(scope="session")
def emulating_comfy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    """The server the shipped workflows run on (tests/integration/test_workflows.py and tests/browser).

    FP8 backends that cannot run on this CPU are emulated (QWEN_EDIT_FP8_EMULATE=1, reported in the node
    output), and the workflows' input picture is in its input folder. ``--cache-lru`` keeps every node
    output of every prompt (ComfyUI's default cache keeps only the last prompt's): a workflow queued again
    with the same inputs, by the API-twin test or from the browser, completes from the cache.
    """
    from fixtures_models import install_tiny_models
    from prompts import write_image
    from workflows import INPUT_IMAGE

    base = tmp_path_factory.mktemp("comfy_workflows")
    install_tiny_models(base / "models")
    server = guarded_server(base)
    server.env["QWEN_EDIT_FP8_EMULATE"] = "1"
    server.extra_args = ("--cache-lru", "200")
    with running(server):
        write_image(server.input_dir / INPUT_IMAGE, 128, 96, seed=5)
        yield server


@pytest.fixture
def fresh_comfy(tmp_path: Path) -> Iterator[ComfyServer]:
    """A server of its own for a test that measures or disturbs process state."""
    from fixtures_models import install_tiny_models

    install_tiny_models(tmp_path / "models")
    with running(guarded_server(tmp_path)) as server:
        yield server


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Attach the log of every running server to a failing test's report."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and SERVERS:
        for server in SERVERS:
            report.sections.append((f"ComfyUI server log ({server.base_dir})", server.log_tail()))
