"""``actors.engine.wiring``: the one place that spawns actors, and statistics that are asked."""

from __future__ import annotations

import re
import time
from pathlib import Path

import anyio
import pytest

from actors.engine import EngineConfig, wiring
from actors.runtime import Actor, ActorSystem, Context, Supervision
from messages import Envelope
from messages.gateway import GatewayStats, GatewayStatsRequest, RunnerStats, RunnerStatsRequest

ACTORS_DIR = Path(__file__).resolve().parents[3] / "actors"


def test_only_the_wiring_spawns_actors() -> None:
    """No module under actors/ calls `.spawn(` except wiring.py and the runtime itself."""
    offenders = []
    for path in ACTORS_DIR.rglob("*.py"):
        rel = path.relative_to(ACTORS_DIR).as_posix()
        if rel.startswith("runtime/") or rel == "engine/wiring.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.spawn\(", line) and not line.lstrip().startswith("#"):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == []


def test_every_actor_spec_is_named_once() -> None:
    """The wiring table names each address once, and every actor that owns state can be
    asked for statistics (the cold tier's workers share the index's state, which reports it)."""
    names = [spec.name for spec in wiring.ACTORS]
    assert len(names) == len(set(names))
    owners = {
        wiring.GATEWAY,
        wiring.RUNNER,
        wiring.PROMPT_CACHE,
        wiring.SSD_WRITER,
        wiring.SPILL_QUEUE,
        wiring.DURABILITY,
    }
    assert owners <= set(names)
    workers = {wiring.SSD_STORE, wiring.SSD_READ, wiring.SSD_SCRUB}
    assert workers <= set(names)
    assert all(spec.stats is not None for spec in wiring.ACTORS if spec.name not in workers)


class _Quick(Actor):
    """Answers a gateway stats ask at once."""

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        await ctx.reply(envelope, GatewayStats(token={"lane": None}, admitted_requests=2))


class _Busy(Actor):
    """Holds its mailbox until ``gate`` opens (a runner in the middle of a long turn)."""

    def __init__(self, gate: anyio.Event) -> None:
        self.gate = gate

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        await self.gate.wait()
        await ctx.reply(envelope, RunnerStats(live_requests=1, decode_steps_run=5))


@pytest.mark.anyio
async def test_stats_answer_within_the_deadline_when_an_actor_is_busy() -> None:
    """A busy actor is reported unavailable after the stats deadline; the others' sections still come back."""
    gate = anyio.Event()
    specs = (
        wiring.ActorSpec(
            "quick", lambda parts: _Quick, capacity=lambda cfg: 4,
            supervision=Supervision("resume"),
            stats=wiring.StatsAsk(GatewayStatsRequest, GatewayStats, "gateway"),
        ),
        wiring.ActorSpec(
            "busy", lambda parts: lambda: _Busy(gate), capacity=lambda cfg: 4,
            supervision=Supervision("resume"),
            stats=wiring.StatsAsk(RunnerStatsRequest, RunnerStats, "gateway"),
        ),
    )
    async with ActorSystem() as system:
        refs = {
            "quick": system.spawn("quick", _Quick, capacity=4),
            "busy": system.spawn("busy", lambda: _Busy(gate), capacity=4),
        }
        wired = wiring.Wired(system=system, refs=refs, specs=specs,
                             config=EngineConfig(stats_timeout_s=0.2))
        began = time.monotonic()
        with anyio.fail_after(5):
            out = await wired.stats()
        elapsed = time.monotonic() - began
        assert out["gateway"] == {"token": {"lane": None}, "admitted_requests": 2}
        assert list(out["unavailable"]) == ["busy"]
        assert "AskTimeout" in out["unavailable"]["busy"]
        assert 0.2 <= elapsed < 2.0
        gate.set()
        answered = await wired.stats(timeout=5.0)
        assert answered["gateway"]["decode_steps_run"] == 5
        assert "unavailable" not in answered


@pytest.mark.anyio
async def test_spawn_prompt_cache_uses_the_production_spec() -> None:
    """The test-facing prompt-cache spawn gets the wiring's mailbox size and supervision."""
    spec = next(s for s in wiring.ACTORS if s.name == wiring.PROMPT_CACHE)

    class _Registry:
        def dispose(self, handle: str) -> None:
            raise KeyError(handle)

        def drain(self) -> int:
            return 0

    async with ActorSystem() as system:
        ref = wiring.spawn_prompt_cache(system, cap_bytes=1000, registry=_Registry())
        assert ref.name == wiring.PROMPT_CACHE
        assert ref.statistics().capacity == spec.capacity(EngineConfig())
