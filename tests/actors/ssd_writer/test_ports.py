"""The cold tier's ports: host staging bounds, re-armed engine turns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import pytest

from actors.runtime import AskTimeout
from actors.ssd_writer import HostStaging, RearmingTurns, StagedEntry
from kernels.cache._file_port import FilePort
from kernels.cache._kv_format import KvFileHeader, LayerRecord, TensorRecord
from kernels.cache._kv_reader import OpenEntry

T = TypeVar("T")


class ClosingPort:
    """Records the descriptors closed through it (all a staged entry asks of its port)."""

    def __init__(self) -> None:
        self.closed: list[int] = []

    def close(self, fd: int) -> None:
        """Record ``fd``."""
        self.closed.append(fd)


PORT = ClosingPort()


def staged(n: int) -> StagedEntry:
    """A staged entry whose file holds ``n`` tensor bytes (descriptor ``n``)."""
    tensor = TensorRecord("state.0", "uint8", (n,), 0, n, 0)
    layer: Any = LayerRecord(
        "arrays", 0, None, None, None, None, None, None, 1, None, (tensor,), ()
    )
    header = KvFileHeader(
        version=1,
        model_id="m",
        fingerprint="f",
        namespace="",
        tokenizer_hash="t",
        created_at=0.0,
        tokens=(1,),
        layers=(layer,),
        file_size=0,
        data_offset=0,
        header_hash=0,
    )
    return StagedEntry("p", OpenEntry(cast("FilePort", PORT), n, "p", header, verify=True))


def test_staging_is_taken_once_and_bounded_oldest_first() -> None:
    """take() hands an entry out once; past the bound the oldest waiting entry is dropped."""
    staging = HostStaging(max_entries=2)
    staging.put("a", staged(1))
    staging.put("b", staged(2))
    staging.put("c", staged(3))
    assert staging.take("a") is None
    assert staging.evicted == 1
    assert staging.nbytes == 5
    got = staging.take("b")
    assert got is not None
    assert got.nbytes == 2
    assert staging.take("b") is None
    staging.discard("c")
    assert len(staging) == 0


class BusyThenIdle:
    """Times out ``busy`` times (the engine stays busy), then runs the step."""

    def __init__(self, busy: int) -> None:
        self.busy = busy
        self.calls = 0

    async def run_when_idle(self, fn: Callable[[], T], *, timeout: float | None = None) -> T:
        """Raise AskTimeout while busy, else run ``fn``."""
        self.calls += 1
        assert timeout == 0.5
        if self.calls <= self.busy:
            raise AskTimeout("gateway", "gateway.run_when_idle", 0.5)
        return fn()


@pytest.mark.anyio
async def test_a_busy_engine_rearms_the_step_instead_of_failing_it() -> None:
    """Deadlines passing while the engine is busy re-ask; the step runs once when idle."""
    inner = BusyThenIdle(busy=3)
    turns = RearmingTurns(inner, wait_s=0.5)
    ran: list[int] = []

    def step() -> int:
        ran.append(1)
        return 7

    assert await turns.run_when_idle(step) == 7
    assert (inner.calls, turns.rearmed, ran) == (4, 3, [1])


@pytest.mark.anyio
async def test_rearming_gives_up_after_the_total_wait() -> None:
    """With max_wait_s the re-arming stops and the timeout reaches the caller."""
    turns = RearmingTurns(BusyThenIdle(busy=10), wait_s=0.5, max_wait_s=1.0)
    with pytest.raises(AskTimeout):
        await turns.run_when_idle(lambda: 1)
