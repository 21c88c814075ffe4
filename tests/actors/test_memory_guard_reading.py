"""The guard's reading of the memory in use (RSS, at least MLX's figures), its settling, the stated margin.

The e2e bound (a real ``kvtier serve`` whose RSS stays within budget +
margin) is ``tests/e2e/test_memory_guard_rss.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.engine.memory import ProcessMemory, resident_memory_bytes
from actors.engine_thread.memory_guard import (
    HOST_SLACK_BYTES,
    Footprint,
    MemoryGauge,
    MemoryGuard,
    stated_margin,
)
from actors.errors import MemoryPressure
from messages.gateway import Generate, GenerationParams

MIB = 1 << 20
_REPO = Path(__file__).resolve().parents[2]
_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


class Script:
    """Scripted readings: each call returns the next value."""

    def __init__(self, *values: int | None) -> None:
        self.values = list(values)

    def __call__(self) -> int | None:
        return self.values.pop(0)

    def int(self) -> int:
        """The next value, as an int."""
        value = self.values.pop(0)
        assert value is not None
        return value


def test_the_reading_is_rss_where_mlx_memory_is_host_memory() -> None:
    """On the CPU RSS holds MLX's buffers, so the reading is RSS (the larger figure)."""
    rss = Script(300 * MIB, 450 * MIB)
    mlx = Script(100 * MIB, 200 * MIB)
    reading = ProcessMemory(rss=rss, mlx=mlx.int)
    assert reading.read() == 450 * MIB
    assert (reading.resident, reading.mlx) == (450 * MIB, 200 * MIB)


def test_the_reading_adds_mlx_growth_to_the_start_rss_where_rss_does_not_show_it() -> None:
    """Device memory outside RSS (CUDA): the RSS at start plus what MLX has added since."""
    rss = Script(300 * MIB, 310 * MIB)
    mlx = Script(100 * MIB, 600 * MIB)
    reading = ProcessMemory(rss=rss, mlx=mlx.int)
    assert reading.read() == 300 * MIB + 500 * MIB


def test_without_an_rss_reading_the_reading_is_at_least_mlx_memory() -> None:
    """Where the OS gives no RSS, MLX's active and cached memory is the floor."""
    reading = ProcessMemory(rss=Script(None, None), mlx=Script(40 * MIB, 90 * MIB).int)
    assert reading.read() == 90 * MIB
    assert reading.resident is None


def test_under_cuda_the_devices_memory_in_use_by_every_process_is_a_floor() -> None:
    """Another process on the card (device used 30 GiB, MLX's own 12 GiB): the reading is the device's figure."""
    gib = 1024 * MIB
    reading = ProcessMemory(rss=Script(2 * gib, 2 * gib), mlx=Script(10 * gib, 12 * gib).int,
                            device=Script(30 * gib))
    assert reading.read() == 30 * gib
    assert reading.device_used == 30 * gib


def test_a_device_reader_that_reports_nothing_leaves_the_reading_to_rss_and_mlx() -> None:
    """No free figure from MLX (``None``): the reading is what it is without a device reader."""
    reading = ProcessMemory(rss=Script(300 * MIB, 310 * MIB), mlx=Script(100 * MIB, 600 * MIB).int,
                            device=Script(None))
    assert reading.read() == 300 * MIB + 500 * MIB
    assert reading.device_used is None


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_resident_memory_is_the_kernels_vmrss() -> None:
    """The RSS reader agrees with /proc/self/status VmRSS (to 4 MiB: the two reads are not atomic)."""
    with open("/proc/self/status") as f:
        vmrss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    rss = resident_memory_bytes()
    assert rss is not None
    assert abs(rss - vmrss) < 4 * MIB


def test_the_stated_margin_is_the_mlx_cache_limit_plus_the_host_slack() -> None:
    """16 MiB of MLX cache (the CPU default) gives 48 MiB; a negative limit is a bug."""
    assert stated_margin(16 * MIB) == 16 * MIB + HOST_SLACK_BYTES == 48 * MIB
    with pytest.raises(ValueError, match=">= 0"):
        stated_margin(-1)


def _guard(readings: Script, settle: Script | None) -> MemoryGuard:
    footprint = Footprint(kv_bytes_at=lambda n: n * 1000, chunk=512)
    return MemoryGuard(budget=1_000_000, footprint=footprint, gauge=MemoryGauge(readings.int),
                       settle=settle)


def _request() -> Generate:
    return Generate(request_id="r", prompt_tokens=tuple(range(1, 101)),
                    params=GenerationParams(max_tokens=100), stream_to="s")


# NOTE: the request's footprint is 2 x 256 tokens x 1,000 bytes = 512,000 bytes.


def test_an_in_turn_check_that_would_refuse_settles_and_decides_on_a_second_reading() -> None:
    """Freed memory the first reading counted is dropped (settle) and the request fits on the second."""
    settled = Script(0)
    guard = _guard(Script(600_000, 400_000), settled)
    guard.before_prefill(_request(), 0)
    assert (guard.settled, guard.refused, settled.values) == (1, 0, [])


def test_an_in_turn_check_refuses_when_the_settled_reading_is_still_over() -> None:
    """Live memory does not settle away: the second reading still over the budget refuses."""
    guard = _guard(Script(600_000, 590_000), Script(0))
    with pytest.raises(MemoryPressure, match="memory budget"):
        guard.before_prefill(_request(), 0)
    assert (guard.settled, guard.refused) == (1, 1)


def test_a_check_that_fits_reads_once_and_never_settles() -> None:
    """The common path costs one reading: no collection, no cache flush."""
    guard = _guard(Script(100_000), Script())
    guard.before_prefill(_request(), 0)
    assert (guard.settled, guard.gauge.samples) == (0, 1)


_FREED_HEAP = r"""
import ctypes
import sys

import anyio
import mlx.core as mx

import kernels
from actors.engine.memory import release_freed_memory, resident_memory_bytes, settle_memory

MIB = 1 << 20


def work():
    mx.set_cache_limit(0)
    settle_memory()
    before = resident_memory_bytes()
    # NOTE: the state a served model leaves glibc in: its large freed buffers
    # raise the dynamic mmap threshold (16 MiB here, trim threshold twice
    # that), so the 1-3 MiB buffers below come from the engine thread's heap,
    # and small live arrays between them keep the freed space from being the
    # heap's top. Set with mallopt, not by freeing a 16 MiB buffer: that free
    # may run on MLX's stream thread after the buffers are allocated (then
    # they were mmapped: flaky, seen on CI in test_heap_trim.py).
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-3, 16 * MIB) == 1  # M_MMAP_THRESHOLD
    assert libc.mallopt(-1, 32 * MIB) == 1  # M_TRIM_THRESHOLD
    keep = []
    for i in range(40):
        a = mx.ones(((1 + i % 3) * MIB // 4,)); mx.eval(a)
        k = mx.ones((1024,)); mx.eval(k); keep.append(k)
        del a
    arrays = [mx.ones(((1 + i % 3) * MIB // 4,)) for i in range(40)]
    mx.eval(arrays)
    keep += [arrays[i][:8] + 0 for i in range(0, 40, 2)]
    mx.eval(keep)
    del arrays
    freed = resident_memory_bytes()
    if sys.argv[1] == "release":
        release_freed_memory(lambda: None)
    else:
        import gc; gc.collect(); mx.clear_cache()
    return (freed - before) // MIB, (resident_memory_bytes() - before) // MIB


async def main():
    thread = kernels.EngineThread(name="t", max_queue=4)
    print(*await thread.run(work))
    await thread.aclose()

anyio.run(main)
"""


def _freed_heap(mode: str) -> tuple[int, int]:
    """MiB above the start right after the arrays are freed, and after ``mode`` (a fresh process)."""
    env = dict(os.environ, PYTHONPATH=str(_REPO))
    if os.path.exists(_OPENBLAS):
        env["LD_PRELOAD"] = _OPENBLAS
    out = subprocess.run([sys.executable, "-c", _FREED_HEAP, mode], cwd=_REPO, env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    freed, after = (int(x) for x in out.stdout.split())
    return freed, after


@pytest.mark.skipif(sys.platform != "linux", reason="glibc heap and /proc RSS")
def test_freed_arrays_leave_rss_once_released() -> None:
    """80 MiB of MLX arrays freed on the engine thread stay resident (glibc's heap), and
    release_freed_memory brings RSS back within 8 MiB of where it started."""
    freed, after = _freed_heap("release")
    assert freed >= 48
    assert after < 8


@pytest.mark.skipif(sys.platform != "linux", reason="glibc heap and /proc RSS")
def test_without_the_heap_trim_freed_arrays_stay_resident() -> None:
    """Control: collecting and clearing MLX's cache alone leaves them in RSS (why the trim)."""
    freed, after = _freed_heap("collect")
    assert freed >= 48
    assert after >= 48
