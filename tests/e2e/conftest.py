"""Fixtures shared by the end-to-end modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .server_process import ServerProcess


@pytest.fixture(scope="session")
def default_model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """kvtier serve on the default model (``--max-tokens 16``, 0.2 GB RAM tier), shared by modules that only send requests."""
    # NOTE: a server start (imports, model load) costs more than most of
    # these modules' requests; modules that signal, stop or configure their
    # server otherwise start their own.
    srv = ServerProcess(tmp_path_factory.mktemp("serve-default"), "--max-tokens", "16",
                        "--prompt-cache", "0.2")
    yield srv
    assert srv.stop() == 0, srv.logs()
