"""Pytest fixtures: a real ComfyUI server with this pack, and its log on failure.

Every server fixture runs once per ComfyUI version the run selects (``--comfyui``, default every version in
``comfy_server.COMFYUI_VERSIONS``); its test ids end in ``comfyui-<version>``. A test that holds for some
versions only says so with ``@pytest.mark.comfyui("0.3.75")``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from comfy_server import COMFYUI_VERSIONS, ComfyServer

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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--comfyui", default="all", metavar="VERSIONS",
                     help=f"ComfyUI versions the server and browser tests run on: 'all' or a comma-separated list of "
                     f"{', '.join(COMFYUI_VERSIONS)} (default: all)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "comfyui(*versions): run this server test on these ComfyUI versions only")


def selected_versions(config: pytest.Config) -> list[str]:
    """The versions ``--comfyui`` names, in COMFYUI_VERSIONS order; an unknown name is a usage error."""
    option = config.getoption("--comfyui")
    if option == "all":
        return list(COMFYUI_VERSIONS)
    wanted = [v.strip() for v in option.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in COMFYUI_VERSIONS]
    if unknown or not wanted:
        raise pytest.UsageError(f"--comfyui {option}: the tests know {', '.join(COMFYUI_VERSIONS)} (or 'all')")
    return [v for v in COMFYUI_VERSIONS if v in wanted]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests that use a server (through ``comfyui_version``) run once per selected ComfyUI version."""
    if "comfyui_version" not in metafunc.fixturenames:
        return
    versions = selected_versions(metafunc.config)
    marker = metafunc.definition.get_closest_marker("comfyui")
    if marker is not None:
        versions = [v for v in versions if v in marker.args]
    metafunc.parametrize("comfyui_version", versions, scope="session", ids=[f"comfyui-{v}" for v in versions])


def guarded_server(base: Path, comfyui_version: str) -> ComfyServer:
    """A server whose Python refuses and logs every non-loopback connection (base/netguard.log)."""
    pythonpath = os.pathsep.join(p for p in (str(NETGUARD_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return ComfyServer(base, comfyui=comfyui_version,
                       env={"PYTHONPATH": pythonpath, "QWEN_EDIT_NETGUARD_LOG": str(base / "netguard.log")})


@pytest.fixture(scope="session")
def comfy(tmp_path_factory: pytest.TempPathFactory, comfyui_version: str) -> Iterator[ComfyServer]:
    """One ComfyUI server per version for the whole test run, with the tiny checkpoints in its model folders."""
    from fixtures_models import install_tiny_models

    base = tmp_path_factory.mktemp(f"comfy-{comfyui_version}")
    install_tiny_models(base / "models")
    with running(guarded_server(base, comfyui_version)) as server:
        yield server


@pytest.fixture(scope="session")
def emulating_comfy(tmp_path_factory: pytest.TempPathFactory, comfyui_version: str) -> Iterator[ComfyServer]:
    """The server the shipped workflows run on (tests/integration/test_workflows.py and tests/browser).

    The tests switch the workflows' ``where_unsupported`` to emulate (tests/prompts.py ``emulating``; the browser
    test in the frontend), so FP8 kernels this CPU cannot run become their fp32 reference paths, reported in the
    node outputs; the workflows' input picture is in its input folder. ``--cache-lru`` keeps every node
    output of every prompt (ComfyUI's default cache keeps only the last prompt's): a workflow queued again
    with the same inputs, by the API-twin test or from the browser, completes from the cache.
    """
    from fixtures_models import install_tiny_models
    from prompts import write_image
    from workflows import INPUT_IMAGE

    base = tmp_path_factory.mktemp(f"comfy_workflows-{comfyui_version}")
    install_tiny_models(base / "models")
    server = guarded_server(base, comfyui_version)
    server.extra_args = ("--cache-lru", "200")
    with running(server):
        write_image(server.input_dir / INPUT_IMAGE, 128, 96, seed=5)
        yield server


@pytest.fixture
def fresh_comfy(tmp_path: Path, comfyui_version: str) -> Iterator[ComfyServer]:
    """A server of its own for a test that measures or disturbs process state."""
    from fixtures_models import install_tiny_models

    install_tiny_models(tmp_path / "models")
    with running(guarded_server(tmp_path, comfyui_version)) as server:
        yield server


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Attach the log of every running server to a failing test's report."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and SERVERS:
        for server in SERVERS:
            report.sections.append((f"ComfyUI server log ({server.base_dir})", server.log_tail()))
