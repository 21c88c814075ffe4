"""Checkpoint lookups run on the port's own bounded pool, not on the event loop's default executor.

A burst of admissions (eight batch rows placed at once) starts as many
lookups; ``CheckpointPort.load_soon`` runs at most ``LOOKUP_THREADS`` of
them at once, on its ``kvtier-ckpt-lookup`` threads, and every one answers.
"""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import pytest

from actors.checkpoints import CheckpointCounters, CheckpointPort, ResumeFrom
from actors.checkpoints.serving import LOOKUP_THREADS

pytestmark = pytest.mark.anyio


class GatedPort(CheckpointPort):
    """A port whose lookups find nothing, each held until ``gate`` opens; counts them running."""

    def __init__(self) -> None:
        super().__init__(every=8, directory="unused", fingerprint="f", port=None,  # type: ignore[arg-type]
                         spill_queue="spill", dispose=lambda _h: None, counters=CheckpointCounters())
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.threads: list[str] = []
        self.full = threading.Event()  # NOTE: set once LOOKUP_THREADS lookups run together.

    def load(self, key: str, namespace: str, prompt: tuple[int, ...]) -> ResumeFrom | None:
        """Wait for the gate (as a slow file read would); no checkpoint."""
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.append(threading.current_thread().name)
            if self.running >= LOOKUP_THREADS:
                self.full.set()
        self.gate.wait(10)
        with self.lock:
            self.running -= 1
        return None


async def test_a_burst_of_lookups_runs_on_the_port_s_bounded_pool() -> None:
    """Six lookups started at once: at most LOOKUP_THREADS run together, all on the port's
    named threads, and every one answers on the loop."""
    port = GatedPort()
    answers: list[ResumeFrom | None] = []
    all_answered = anyio.Event()

    def answer(found: ResumeFrom | None) -> None:
        answers.append(found)
        if len(answers) == 6:
            all_answered.set()

    for i in range(6):
        port.load_soon(f"{i:032x}", "", (1, 2, 3), answer, request_id=f"r{i}")
    assert await anyio.to_thread.run_sync(port.full.wait, 5)
    await anyio.sleep(0.2)  # NOTE: room for a third lookup to start, were the pool larger.
    assert port.running == LOOKUP_THREADS
    port.gate.set()
    with anyio.fail_after(5):
        await all_answered.wait()
    assert answers == [None] * 6
    assert port.most == LOOKUP_THREADS
    assert all(name.startswith("kvtier-ckpt-lookup") for name in port.threads)
