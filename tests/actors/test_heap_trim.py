"""The engine's C heap trim (``actors/engine/memory.py`` ``HeapTrim``): its rule on scripted
readings, and on a real process that MLX memory freed by an engine job leaves RSS.

The measurement behind it (200 requests, 8 batch rows, the SSD tier): docs/benchmarks/batching.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.engine.memory import HeapTrim

MIB = 1 << 20
_REPO = Path(__file__).resolve().parents[2]
_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


class Process:
    """A scripted process: RSS and MLX memory set by the test; ``trim`` gives back ``freeable``."""

    def __init__(self, rss: int, mlx: int, *, has_rss: bool = True) -> None:
        self.rss = rss
        self.has_rss = has_rss
        self.mlx = mlx
        self.freeable = 0
        self.trim_calls = 0
        self.now = 0.0

    def read_rss(self) -> int | None:
        return self.rss if self.has_rss else None

    def read_mlx(self) -> int:
        return self.mlx

    def trim(self) -> bool:
        self.trim_calls += 1
        self.now += 0.002
        if self.freeable == 0:
            return False
        self.rss -= self.freeable
        self.freeable = 0
        return True

    def clock(self) -> float:
        return self.now

    def heap_trim(self, threshold: int = 32 * MIB) -> HeapTrim:
        return HeapTrim(threshold=threshold, rss=self.read_rss, mlx=self.read_mlx,
                        trim=self.trim, clock=self.clock)


def test_no_trim_while_rss_grows_with_mlx_memory() -> None:
    """Live MLX memory growing is not heap slack: RSS - MLX stays put, nothing is trimmed."""
    p = Process(rss=700 * MIB, mlx=540 * MIB)
    heap = p.heap_trim()
    for step in range(10):
        p.rss += 50 * MIB
        p.mlx += 50 * MIB
        assert heap.after_job() is False, step
    assert (p.trim_calls, heap.trims) == (0, 0)


def test_trims_once_rss_holds_the_threshold_more_than_mlx_explains() -> None:
    """Freed-but-resident heap of 31 MiB waits; at 32 MiB it is trimmed and the floor is read again."""
    p = Process(rss=700 * MIB, mlx=540 * MIB)
    heap = p.heap_trim()
    heap.after_job()
    p.rss += 31 * MIB
    p.freeable = 31 * MIB
    assert heap.after_job() is False
    p.rss += 1 * MIB
    p.freeable += 1 * MIB
    assert heap.after_job() is True
    assert (p.rss, heap.trims, p.trim_calls) == (700 * MIB, 1, 1)
    assert heap.trim_s == pytest.approx(0.002)
    p.rss += 31 * MIB
    assert heap.after_job() is False


def test_the_floor_follows_the_excess_down() -> None:
    """After the process frees host memory, slack is measured from the lower floor."""
    p = Process(rss=700 * MIB, mlx=540 * MIB)
    heap = p.heap_trim()
    heap.after_job()
    p.rss -= 20 * MIB  # NOTE: host memory (not MLX) given back: the excess falls 20 MiB.
    heap.after_job()
    p.rss += 32 * MIB
    p.freeable = 32 * MIB
    assert heap.after_job() is True


def test_a_trim_that_gives_nothing_back_does_not_repeat_every_job() -> None:
    """Host memory that is live (a trim frees nothing) becomes the floor: one trim, not one per job."""
    p = Process(rss=700 * MIB, mlx=540 * MIB)
    heap = p.heap_trim()
    heap.after_job()
    p.rss += 40 * MIB
    assert heap.after_job() is False
    for _ in range(5):
        heap.after_job()
    assert (p.trim_calls, heap.trims) == (1, 0)


def test_without_an_rss_reading_it_never_trims() -> None:
    """Where the OS gives no RSS there is nothing to compare: no trim."""
    p = Process(rss=700 * MIB, mlx=540 * MIB, has_rss=False)
    heap = p.heap_trim()
    for _ in range(3):
        assert heap.after_job() is False
    assert p.trim_calls == 0


def test_the_threshold_must_be_positive() -> None:
    """A zero threshold would trim after every job: refused."""
    with pytest.raises(ValueError, match="> 0"):
        HeapTrim(threshold=0)


# NOTE: a real Engine (tiny Llama) in a fresh process, so RSS is this
# engine's alone. The job frees ~80 MiB of C heap buffers (what MLX's CPU
# buffers are: malloc'd on the evaluating thread) from the engine thread's
# glibc arena with small live blocks between them (the pattern of KV
# buffers and registry entries freed while others live). NOTE: plain
# malloc, not MLX arrays: which thread allocates, frees and faults in an
# MLX buffer is MLX's choice, and about 1 run in 15 its 1-3 MiB buffers
# took no RSS the trim could give back ("0 0"), so the test saw nothing.
_ENGINE_JOB = r"""
import ctypes

import anyio

from actors.engine import Engine
from actors.engine.memory import resident_memory_bytes
from tests.tiny_models import tiny_llama, tiny_tokenizer

MIB = 1 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.realloc.restype = ctypes.c_void_p
libc.realloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
keep = []


def settled():
    # NOTE: start from a heap with no free-but-resident pages (model load
    # and warm-up leave some), in a job of its own, so the engine's trim
    # rule reads its floor here.
    libc.malloc_trim(0)
    return resident_memory_bytes()


def fragment():
    # NOTE: the state a served model leaves glibc in: its large freed
    # buffers raise the dynamic mmap threshold (to 16 MiB here, trim
    # threshold twice that), so 1-3 MiB buffers come from the arena.
    assert libc.mallopt(M_MMAP_THRESHOLD, 16 * MIB) == 1
    assert libc.mallopt(M_TRIM_THRESHOLD, 32 * MIB) == 1
    blocks = []
    for i in range(41):
        size = (1 + i % 3) * MIB
        block = libc.malloc(size)
        assert block
        ctypes.memset(block, 1, size)
        blocks.append(block)
    # NOTE: every other block shrinks in place to 256 bytes (glibc's
    # realloc splits a smaller request off the same chunk), so the freed
    # space lies in holes between live blocks and cannot join the arena's
    # top (a small malloc would come from the free lists, not in between).
    for i, block in enumerate(blocks):
        if i % 2:
            libc.free(block)
        else:
            assert libc.realloc(block, 256) == block
            keep.append(block)
    return resident_memory_bytes()


async def main():
    engine = Engine.from_loaded(tiny_llama(vocab_size=len(tiny_tokenizer())), tiny_tokenizer(),
                                model_id="tiny", prompt_cache_bytes=16 * MIB)
    async with engine:
        before = await engine.run_when_idle(settled)
        freed = await engine.run_when_idle(fragment)
        after = await engine.run_when_idle(resident_memory_bytes)
    print((freed - before) // MIB, (after - before) // MIB)

anyio.run(main)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc heap and /proc RSS")
def test_heap_memory_freed_in_an_engine_job_leaves_rss_after_the_job() -> None:
    """~80 MiB of C heap buffers freed inside one engine job leave RSS when the job ends
    (before the trim they stayed: RSS +80 MiB for good)."""
    env = dict(os.environ, PYTHONPATH=str(_REPO))
    if os.path.exists(_OPENBLAS):
        env["LD_PRELOAD"] = _OPENBLAS
    out = subprocess.run([sys.executable, "-c", _ENGINE_JOB], cwd=_REPO, env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    freed, after = (int(x) for x in out.stdout.split()[-2:])
    assert freed >= 48, out.stdout
    assert after < 16, out.stdout
