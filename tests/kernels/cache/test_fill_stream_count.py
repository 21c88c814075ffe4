"""The landing's fill streams: how many the product uses, and that they are made once per thread."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import pytest

from actors.ssd_writer import HostStaging
from kernels.cache import (
    FILL_STREAMS_ENV,
    LANDING_THREADS_ENV,
    default_fill_streams,
    fill_stream_count,
    landing_thread_count,
)
from kernels.cache._kv_landing import land_entry
from kernels.cache._kv_reader import open_entry
from tests.kernels.cache.test_kv_file import write_entry
from tests.kernels.cache.test_kv_file_landing import PORT, _all_bytes, _cases, _header

T = TypeVar("T")


def _on_new_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a fresh thread (fill streams are cached per thread) and return its result."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result(timeout=60)


@pytest.mark.parametrize(
    ("cpus", "override", "expected"),
    [
        (1, None, 1),
        (2, None, 2),
        (3, None, 2),
        (5, None, 2),
        (6, None, 3),
        (8, None, 4),
        (12, None, 6),
        (16, None, 8),
        (128, None, 8),
        (16, "1", 1),
        (1, "2", 2),
        (2, " 3 ", 3),
        (2, "8", 8),
        (16, "9", 8),
        (16, "0", 8),
        (16, "-1", 8),
        (1, "yes", 1),
        (16, "", 8),
    ],
)
def test_fill_stream_count_follows_cpus_unless_overridden(
    cpus: int, override: str | None, expected: int
) -> None:
    """One fill stream per 2 usable CPUs, from 2 up to 8 (1 on one CPU); an override 1-8 wins."""
    assert fill_stream_count(cpus, override) == expected


@pytest.mark.parametrize(
    ("cpus", "override", "expected"),
    [
        (1, None, 2),
        (2, None, 2),
        (7, None, 2),
        (8, None, 4),
        (64, None, 4),
        (2, "1", 1),
        (64, "16", 16),
        (64, "17", 4),
        (2, "x", 2),
    ],
)
def test_landing_thread_count_follows_cpus_unless_overridden(
    cpus: int, override: str | None, expected: int
) -> None:
    """Two landing threads, four from 8 usable CPUs; an override from 1 to 16 wins."""
    assert landing_thread_count(cpus, override) == expected


def test_the_staging_sizes_its_landing_threads_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A staging built without a count takes the override, and an explicit count wins over it."""
    monkeypatch.setenv(LANDING_THREADS_ENV, "3")
    staging = HostStaging()
    explicit = HostStaging(landing_threads=1)
    try:
        assert staging.landing_threads == 3
        assert explicit.landing_threads == 1
    finally:
        staging.close()
        explicit.close()


def test_default_fill_streams_are_made_once_per_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread gets the same streams on every call, another thread its own, sized by the override."""
    monkeypatch.setenv(FILL_STREAMS_ENV, "2")

    def twice() -> tuple[list[Any], list[Any]]:
        return default_fill_streams(), default_fill_streams()

    first, again = _on_new_thread(twice)
    other, _ = _on_new_thread(twice)
    assert first is again
    assert len(first) == 2
    assert first[0] == mx.cpu
    assert first[1] != mx.cpu
    assert other is not first
    monkeypatch.setenv(FILL_STREAMS_ENV, "1")
    single, _ = _on_new_thread(twice)
    assert single == [mx.cpu]


def _land_bytes(path: Path, streams: list[Any] | None) -> list[Any]:
    entry = open_entry(PORT, str(path), _header(path))
    try:
        return _all_bytes(land_entry(entry, step=4, streams=streams))
    finally:
        entry.close()


@pytest.mark.parametrize("count", ["1", "2"])
def test_default_landing_lands_the_same_bytes_with_either_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: str
) -> None:
    """A landing on the default streams, one or two, gives every kind's bytes as one explicit stream does."""
    monkeypatch.setenv(FILL_STREAMS_ENV, count)
    for case, (caches, tokens) in _cases().items():
        (tmp_path / case).mkdir()
        path = write_entry(caches, tokens, tmp_path / case)

        default = _on_new_thread(functools.partial(_land_bytes, path, None))
        explicit = _on_new_thread(functools.partial(_land_bytes, path, [mx.cpu]))
        assert default == explicit, case
