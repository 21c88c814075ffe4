"""Fixtures shared by the whole suite."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog

from actors.runtime import set_tracing
from actors.runtime._tracing import KVTIER_HANDLER

# NOTE: the real-model fixtures (default_model_path, ...) for every test module,
# without per-module imports that linters read as unused or redefined names.
pytest_plugins = ["tests.model_fixtures"]


@pytest.fixture
def anyio_backend() -> str:
    """Run anyio tests on asyncio only (the server's loop)."""
    return "asyncio"


@pytest.fixture
def restore_structlog() -> Iterator[None]:
    """Undo ``configure_logging`` (and any bound context) after the test."""
    try:
        yield
    finally:
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
        set_tracing(False)
        root = logging.getLogger()
        for handler in [h for h in root.handlers if getattr(h, KVTIER_HANDLER, False)]:
            root.removeHandler(handler)
        root.setLevel(logging.WARNING)


_exit_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remember the session's exit status for :func:`pytest_unconfigure`."""
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """With OpenBLAS preloaded, leave without interpreter finalization.

    NOTE: with Debian's OpenBLAS preloaded into MLX, a process that ran MLX
    work on a thread other than the main one aborts at exit in some runs
    ("terminate called without an active exception", SIGABRT, during C++
    static teardown, after every Python finalizer; 1-6 in 10 runs of a
    script that only loads a model on a thread; never without the preload).
    `kvtier serve` exits the same way after a graceful stop. The report is
    already written here; only the exit code is left to give.
    """
    import os
    import sys

    if "openblas" in os.environ.get("LD_PRELOAD", "") and _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])
