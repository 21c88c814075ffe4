"""The staging lands on the product's fill streams: the calling (engine) thread's ``landing_streams()``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import actors.ssd_writer.ports as ports
from actors.ssd_writer import HostStaging
from kernels.cache import cache_arrays, landing_streams
from kernels.cache._file_port import OsFilePort
from tests.actors.ssd_writer.test_landing_staging import TOKENS, _staged
from tests.kernels.cache.test_kv_file import _filled_kv, raw, write_entry


def test_the_staging_lands_on_the_calling_threads_fill_streams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``HostStaging.land`` hands ``land_entry`` this thread's fill streams and the bytes land unchanged."""
    original: Any = _filled_kv(len(TOKENS), seed=4)
    path = write_entry([original], TOKENS, tmp_path)
    seen: list[Any] = []
    real = ports.__dict__["land_entry"]

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("streams"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ports, "land_entry", recording)
    staging = HostStaging(max_entries=2)
    try:
        caches = staging.land(_staged(OsFilePort(writeback=None), path))
    finally:
        staging.close()
    assert seen == [landing_streams()]
    landed = cache_arrays(caches)
    n = len(TOKENS)
    assert [raw(a[..., :n, :]) for a in landed] == [
        raw(original.keys[..., :n, :]),
        raw(original.values[..., :n, :]),
    ]
