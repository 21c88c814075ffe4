"""The idle scrubber: a thin shell over ``actors.ssd_writer.scrubber_core``.

It performs the core's effects: the alarm, the ask for an idle engine turn
(the gateway's ``RunWhenIdle`` of the standing no-op gate step), the ask for
the next file (``ScrubPick``), the re-verification and the removal of a bad
file on the tier's worker pool, and the report to the index. Each outcome
goes back into the core as the next event; the shell awaits it, since the
scrubber's mailbox holds nothing but its own wakes.
"""

from __future__ import annotations

from typing import assert_never

from actors.runtime import (
    Actor,
    ActorStopped,
    Alarm,
    Context,
    LoopAlarm,
    MailboxClosed,
    RuntimeFailure,
    UnknownAddress,
    get_logger,
)
from kernels.cache import CacheFileCorrupt, CacheFileIncompatible
from messages import Envelope
from messages.gateway import RunWhenIdle, TurnDone
from messages.ssd_writer import ScrubPick, ScrubTarget, ScrubWake

from . import io
from . import scrubber_core as core
from .actor import ColdTier
from .shell import feed, warn_file

__all__ = ["Scrubber"]

_log = get_logger("kvtier.ssd_writer")


class Scrubber(Actor):
    """Re-verifies stored files' hashes while the engine is idle, one file per alarm.

    Each round asks the gateway for one idle engine turn of the standing
    no-op step ``gate_step`` (granted only when no request runs or waits),
    then takes the next file from the index (round robin) and checks every
    tensor's hash on the worker pool, through one reused buffer. A bad file
    is unlinked (not when read-only) and reported; the index drops it. The
    next round comes ``scrub_interval_s`` later, or later still so that the
    bytes read stay under ``scrub_bytes_per_s``. ``gateway`` ``None`` skips
    the idleness check (tests).
    """

    def __init__(
        self,
        tier: ColdTier,
        *,
        gateway: str | None,
        gate_step: str,
        alarm: Alarm | None = None,
    ) -> None:
        self._tier = tier
        self._gateway = gateway
        self._gate_step = gate_step
        self._alarm = alarm
        config = tier.config
        self._state = core.ScrubberState(
            interval_s=config.scrub_interval_s,
            bytes_per_s=config.scrub_bytes_per_s,
            idle_wait_s=config.scrub_idle_wait_s,
        )

    async def started(self, ctx: Context) -> None:
        """Arm the first round one interval from now."""
        if self._alarm is None:
            self._alarm = LoopAlarm(ctx.clock)
        await self._feed(core.Started(ctx.clock.now()), ctx)

    async def stopped(self, ctx: Context) -> None:
        """Cancel the alarm."""
        if self._alarm is not None:
            self._alarm.set(None, _nothing)

    async def receive(self, envelope: Envelope, ctx: Context) -> None:
        """One round per ``ScrubWake``."""
        body = envelope.body
        if not isinstance(body, ScrubWake):
            raise TypeError(f"scrubber has no rule for {body.kind!r}")
        await self._feed(core.Woke(ctx.clock.now()), ctx)

    async def _feed(self, event: core.Event, ctx: Context) -> None:
        async def perform(effect: core.Effect) -> core.Event | None:
            return await self._perform(effect, ctx)

        self._state = await feed(ctx, core.handle, self._state, event, perform)

    async def _perform(self, effect: core.Effect, ctx: Context) -> core.Event | None:
        tier = self._tier
        match effect:
            case core.Arm(at=at):
                self._arm(ctx, at)
            case core.AskIdle(deadline=deadline):
                return core.IdleAnswered(await self._idle(deadline, ctx), ctx.clock.now())
            case core.AskPick():
                try:
                    target: ScrubTarget | None = await ctx.ask(
                        tier.name, ScrubPick(), timeout=tier.config.ask_timeout, expect=ScrubTarget
                    )
                except RuntimeFailure:
                    target = None  # NOTE: the index is restarting or stopping: next round.
                return core.Picked(target, ctx.clock.now())
            case core.Verify():
                return await self._verify(effect, ctx)
            case core.RemoveBad(path=path):
                removal = await tier.run(io.remove_durably, tier.port, (path,))
                return core.BadRemoved(removal.gone == (path,), ctx.clock.now())
            case core.Report(body=report):
                try:
                    await ctx.tell(tier.name, report)
                except RuntimeFailure:
                    _log.warning("ssd_cache.scrub_report_lost", path=report.path,
                                 reason=report.reason)
            case core.Log(event=name, path=path, error=error, removed=removed):
                warn_file(name, path, error, removed)
            case _:
                assert_never(effect)
        return None

    async def _verify(self, effect: core.Verify, ctx: Context) -> core.Verified:
        tier = self._tier
        try:
            checked = await tier.run(
                io.verify_entry,
                tier.port,
                effect.path,
                fingerprint=tier.config.identity.fingerprint,
                namespace=effect.namespace,
                tokens=effect.tokens,
                max_header_bytes=tier.config.max_header_bytes,
            )
        except (CacheFileCorrupt, CacheFileIncompatible) as exc:
            return core.Verified("corrupt", ctx.clock.now(), error=str(exc))
        except FileNotFoundError:
            return core.Verified("gone", ctx.clock.now())
        except OSError as exc:
            return core.Verified("io_error", ctx.clock.now(), error=str(exc))
        return core.Verified("ok", ctx.clock.now(), nbytes=checked)

    async def _idle(self, deadline: float, ctx: Context) -> bool:
        """Whether the gateway granted the gate step (the engine was idle) before ``deadline``."""
        if self._gateway is None:
            return True
        wait = max(0.0, deadline - ctx.clock.now())
        ask = RunWhenIdle(step_id=self._gate_step, label="ssd_writer.scrub", deadline=deadline)
        try:
            done = await ctx.ask(self._gateway, ask, timeout=wait, expect=TurnDone)
        except RuntimeFailure:
            return False  # NOTE: busy the whole time (or stopping): skip this round.
        return done.ok

    def _arm(self, ctx: Context, at: float) -> None:
        alarm = self._alarm
        if alarm is None:
            return
        ref = ctx.self_ref

        def wake() -> None:
            try:
                # NOTE: a full mailbox already holds a wake; nothing is lost.
                ref.try_tell(ScrubWake())
            except (ActorStopped, MailboxClosed, UnknownAddress):
                return

        alarm.set(at, wake)


def _nothing() -> None:
    return None
