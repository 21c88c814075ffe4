"""Background work's bounded share of engine time under load (gateway core, simulated clock).

A scripted load keeps the serial lane (or the batch lane) busy for ever; one
background asker always waits (it asks again as soon as its step ends), as
write-behind and the SSD writer do under sustained load. The core must
grant it steps at the stated rate and no more:

    background time <= s/(1-s) * (request + batch time) + cap + one step
    a waiting step is granted within one foreground turn + its refill time

and with ``background_share == 0`` (the design's rule) never while load lasts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from actors.gateway.core import (
    DEFAULT_BACKGROUND_SHARE,
    AdmitRequest,
    BackgroundTurnDone,
    BatchStatus,
    BatchTurnDone,
    ConfirmBackground,
    CoreEvent,
    Effect,
    GatewayState,
    LendBackground,
    LentBackgroundDone,
    PreemptBatchTurn,
    PreemptTurn,
    RequestTurnDone,
    RunBackgroundTurn,
    RunBatchTurn,
    RunRequestTurn,
    WantBackgroundTurn,
    handle,
)


@dataclass
class Load:
    """A simulated engine under load that never stops: each foreground step takes ``fg_step_s``
    (a turn runs its granted steps, or one when told to stop early), each background step
    ``bg_step_s``; the background asker asks again as soon as its step ends."""

    state: GatewayState
    fg_step_s: float
    bg_step_s: float
    batch: bool = False
    askers: int = 1
    """Background askers always waiting (write-behind, checkpoints, the scrubber may wait at once)."""
    now: float = 0.0
    bg_asked_at: float = 0.0
    waits: list[float] = field(default_factory=list)
    longest_turn_s: float = 0.0
    fg_s: float = 0.0
    bg_s: float = 0.0
    steps: int = 0
    grants: list[str] = field(default_factory=list)
    """Each grant in order: ``bg`` or ``fg``."""

    def feed(self, event: CoreEvent) -> list[Effect]:
        self.state, effects = handle(self.state, event)
        return effects

    def run(self, until: float) -> None:
        """Drive turns until the clock passes ``until``; one turn in flight at a time."""
        if self.batch:
            effects = self.feed(BatchStatus(busy=True, ready=True, now=0.0))
        else:
            effects = self.feed(AdmitRequest("long", now=0.0))
        for a in range(self.askers):
            effects += self.feed(WantBackgroundTurn(f"bg-{a}-0", now=0.0))
        while self.now < until:
            grants = [e for e in effects
                      if isinstance(e, RunRequestTurn | RunBackgroundTurn | RunBatchTurn)]
            cut = any(isinstance(e, PreemptTurn | PreemptBatchTurn) for e in effects)
            (grant,) = grants
            self.grants.append("bg" if isinstance(grant, RunBackgroundTurn) else "fg")
            if isinstance(grant, RunBackgroundTurn):
                self.waits.append(self.now - self.bg_asked_at)
                self.now += self.bg_step_s
                self.bg_s += self.bg_step_s
                self.steps += 1
                effects = self.feed(BackgroundTurnDone(grant.step_id, now=self.now))
                self.bg_asked_at = self.now
                asker = grant.step_id.split("-")[1]
                more = self.feed(WantBackgroundTurn(f"bg-{asker}-{self.steps}", now=self.now))
                # NOTE: a cut asked for while the foreground turn runs its first step.
                effects += more
                continue
            steps = 1 if cut else grant.max_steps
            held = steps * self.fg_step_s
            self.longest_turn_s = max(self.longest_turn_s, held)
            self.now += held
            self.fg_s += held
            if isinstance(grant, RunBatchTurn):
                effects = self.feed(BatchTurnDone(busy=True, ready=True, now=self.now, steps=steps))
            else:
                effects = self.feed(
                    RequestTurnDone("long", "decode", "continue", now=self.now, steps=steps)
                )


@pytest.mark.parametrize("lane", ["serial", "batch"])
@pytest.mark.parametrize(("fg_step_s", "bg_step_s"), [(0.02, 0.002), (0.005, 0.0005), (0.01, 0.03)])
def test_background_gets_its_share_under_sustained_load_and_no_more(
    lane: str, fg_step_s: float, bg_step_s: float
) -> None:
    """Under load that never ends (64-step bursts or chains), background time stays within the
    stated bound, reaches at least half of it (progress), and every waiting step is granted
    within one step while credit lasts, else one turn after its refill."""
    share = DEFAULT_BACKGROUND_SHARE
    state = GatewayState(max_queue=4, max_burst=64, background_share=share)
    load = Load(state, fg_step_s, bg_step_s, batch=lane == "batch")
    load.run(until=60.0)
    ratio = share / (1 - share)
    bound = ratio * load.fg_s + state.background_credit_cap_s + bg_step_s
    assert load.bg_s <= bound
    assert load.bg_s >= 0.5 * ratio * load.fg_s
    # NOTE: the foreground time that repays one step's overdraft, then the turn in flight.
    refill_s = bg_step_s / ratio
    assert max(load.waits) <= refill_s + load.longest_turn_s + 1e-9
    snap = state.snapshot(load.now)["background_under_load"]
    assert isinstance(snap, dict)
    assert snap["turns"] in (load.steps, load.steps + 1)  # NOTE: the last grant never ran.
    assert snap["held_s"] == pytest.approx(load.bg_s)


@pytest.mark.parametrize("lane", ["serial", "batch"])
def test_under_load_background_runs_one_step_at_a_time(lane: str) -> None:
    """With credit for hundreds of short background steps and three askers always waiting, each
    background step is followed by a foreground step: a ready row waits for one background step,
    never for the whole credit."""
    state = GatewayState(max_queue=4, max_burst=64, background_share=DEFAULT_BACKGROUND_SHARE,
                         background_credit_cap_s=0.25)
    load = Load(state, fg_step_s=0.01, bg_step_s=0.0005, batch=lane == "batch", askers=3)
    load.run(until=30.0)
    assert load.grants.count("bg") > 100
    pairs = list(zip(load.grants, load.grants[1:], strict=False))
    assert ("bg", "bg") not in pairs
    # NOTE: and background still takes its share (one step per foreground step at most).
    ratio = DEFAULT_BACKGROUND_SHARE / (1 - DEFAULT_BACKGROUND_SHARE)
    assert load.bg_s >= 0.5 * min(ratio * load.fg_s, load.grants.count("fg") * 0.0005)


@pytest.mark.parametrize("lane", ["serial", "batch"])
def test_share_zero_keeps_the_design_rule_no_background_under_load(lane: str) -> None:
    """With background_share 0 a waiting step never runs while the load lasts."""
    state = GatewayState(max_queue=4, max_burst=64, background_share=0.0)
    load = Load(state, 0.02, 0.002, batch=lane == "batch")
    load.run(until=10.0)
    assert load.steps == 0
    assert state.stats.background_turns == 0


def test_an_idle_engine_grants_background_without_spending_credit() -> None:
    """Idle turns stay free: background runs at once with no credit, and the credit is unchanged."""
    state = GatewayState(max_queue=4, background_share=DEFAULT_BACKGROUND_SHARE)
    state, effects = handle(state, WantBackgroundTurn("bg", now=1.0))
    assert effects == [RunBackgroundTurn("bg")]
    state, _ = handle(state, BackgroundTurnDone("bg", now=3.0))
    assert state.background_credit_s == 0.0
    assert state.stats.background_under_load == 0


def test_bad_shares_are_refused() -> None:
    """A share outside [0, 1) or a negative cap is a ValueError at construction."""
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="background_share"):
            GatewayState(max_queue=1, background_share=bad)
    with pytest.raises(ValueError, match="credit_cap"):
        GatewayState(max_queue=1, background_credit_cap_s=-1.0)


def test_an_idle_only_step_never_cuts_a_chain_and_runs_once_the_engine_idles() -> None:
    """An idle-only ask (the prompt cache's drain) waits through chains and lets an ordinary ask pass; asked on an idle engine it runs at once."""
    state = GatewayState(max_queue=4, max_burst=64, background_share=DEFAULT_BACKGROUND_SHARE)
    state, effects = handle(state, BatchStatus(busy=True, ready=True, now=0.0))
    assert [type(e) for e in effects] == [RunBatchTurn]
    # NOTE: a long chain earns the background share plenty of credit.
    state, effects = handle(state, BatchTurnDone(busy=True, ready=True, now=10.0, steps=64))
    assert [type(e) for e in effects] == [RunBatchTurn]
    state, effects = handle(state, WantBackgroundTurn("drain", now=10.0, idle_only=True))
    assert not any(isinstance(e, PreemptBatchTurn | RunBackgroundTurn) for e in effects)
    # NOTE: an ordinary ask behind it is due: it cuts the chain and is granted first.
    state, effects = handle(state, WantBackgroundTurn("spill", now=10.5))
    assert any(isinstance(e, PreemptBatchTurn) for e in effects)
    state, effects = handle(state, BatchTurnDone(busy=True, ready=True, now=11.0, steps=1))
    assert effects == [RunBackgroundTurn("spill")]
    state, effects = handle(state, BackgroundTurnDone("spill", now=11.01))
    assert [type(e) for e in effects] == [RunBatchTurn]
    idle = GatewayState(max_queue=4, max_burst=64, background_share=DEFAULT_BACKGROUND_SHARE)
    idle, effects = handle(idle, WantBackgroundTurn("drain", now=0.0, idle_only=True))
    assert effects == [RunBackgroundTurn("drain")]


def test_an_idle_only_step_is_confirmed_by_the_first_turn_granted_after_its_ask() -> None:
    """Under load an idle-only ask is answered done when a batch or request turn granted after it ends; the turn in flight at the ask, a failed or a stepless one confirms nothing."""
    state = GatewayState(max_queue=4, max_burst=64, background_share=DEFAULT_BACKGROUND_SHARE)
    state, _ = handle(state, BatchStatus(busy=True, ready=True, now=0.0))
    state, effects = handle(state, WantBackgroundTurn("drain", now=0.5, idle_only=True))
    assert effects == []
    # NOTE: chain 1 was granted before the ask: it may have drained before the disposal.
    state, effects = handle(state, BatchTurnDone(busy=True, ready=True, now=1.0, steps=64))
    assert effects == [RunBatchTurn(2, 64)]
    # NOTE: a chain that ran no step drained nothing.
    state, effects = handle(state, BatchTurnDone(busy=True, ready=True, now=1.1, steps=0))
    assert effects == [RunBatchTurn(3, 64)]
    state, effects = handle(state, BatchTurnDone(busy=True, ready=True, now=2.0, steps=64))
    assert effects == [ConfirmBackground("drain"), RunBatchTurn(4, 64)]
    assert not state.background
    assert state.stats.background_confirmed == 1
    assert state.snapshot(2.0)["background_confirmed"] == 1

    lane = GatewayState(max_queue=4, max_burst=4)
    lane, _ = handle(lane, AdmitRequest("r1", now=0.0))
    assert lane.turn is not None
    assert lane.turn.owner == "request"
    lane, _ = handle(lane, WantBackgroundTurn("drain", now=0.1, idle_only=True))
    lane, effects = handle(lane, RequestTurnDone("r1", "prefill", "continue", now=0.2))
    assert effects == [RunRequestTurn("r1", 4)]
    # NOTE: a failed turn may never have run; it confirms nothing.
    lane, effects = handle(lane, RequestTurnDone("r1", "decode", "failed", now=0.3))
    assert effects == [RunBackgroundTurn("drain")]
    lane, _ = handle(lane, BackgroundTurnDone("drain", now=0.4))
    lane, _ = handle(lane, AdmitRequest("r2", now=0.5))
    lane, _ = handle(lane, WantBackgroundTurn("drain", now=0.6, idle_only=True))
    lane, effects = handle(lane, RequestTurnDone("r2", "prefill", "continue", now=0.7))
    assert effects == [RunRequestTurn("r2", 4)]
    lane, effects = handle(lane, RequestTurnDone("r2", "decode", "finished", now=0.8))
    assert effects == [ConfirmBackground("drain")]
    assert lane.stats.background_confirmed == 1


def _lending_state() -> GatewayState:
    return GatewayState(max_queue=4, max_burst=64, background_share=DEFAULT_BACKGROUND_SHARE,
                        chain_background=True)


def test_a_due_step_is_lent_to_the_running_chain_instead_of_cutting_it() -> None:
    """With chain_background, a due step goes to the chain in flight (no PreemptBatchTurn); one at a time; its time is charged as a granted step's."""
    state = _lending_state()
    state, effects = handle(state, BatchStatus(busy=True, ready=True, now=0.0))
    assert effects == [RunBatchTurn(1, 64)]
    state, effects = handle(state, BatchTurnDone(busy=True, ready=True, now=10.0, steps=64))
    assert effects == [RunBatchTurn(2, 64)]
    credit = state.background_credit_s
    assert credit > 0.0
    state, effects = handle(state, WantBackgroundTurn("spill", now=10.0))
    assert effects == [LendBackground(2, "spill")]
    # NOTE: one lent step at a time: the next due one waits for its report.
    state, effects = handle(state, WantBackgroundTurn("clone", now=10.1))
    assert effects == []
    state, effects = handle(state, LentBackgroundDone("spill", now=10.2, ran=True, held_s=0.03))
    assert effects == [LendBackground(2, "clone")]
    assert state.background_credit_s == pytest.approx(credit - 0.03)
    state, effects = handle(state, LentBackgroundDone("clone", now=10.3, ran=True, held_s=0.02))
    assert effects == []
    state, effects = handle(state, BatchTurnDone(busy=True, ready=True, now=12.0, steps=64))
    assert effects == [RunBatchTurn(3, 64)]
    stats = state.stats
    assert (stats.background_turns, stats.background_in_chain, stats.background_under_load) == (2, 2, 2)
    assert stats.batch_preempted == 0
    # NOTE: the lent 0.05 s were background time, not batch time.
    assert stats.batch_held_s == pytest.approx(10.0 + 2.0 - 0.05)
    assert stats.background_under_load_s == pytest.approx(0.05)


def test_a_lent_step_the_chain_hands_back_keeps_its_place_and_that_chain_is_cut_for_it() -> None:
    """A step handed back unrun (the chain was ending) heads the queue again; the turn in flight is cut once, not lent to again."""
    state = _lending_state()
    state, _ = handle(state, BatchStatus(busy=True, ready=True, now=0.0))
    state, _ = handle(state, BatchTurnDone(busy=True, ready=True, now=10.0, steps=64))
    state, effects = handle(state, WantBackgroundTurn("spill", now=10.0))
    assert effects == [LendBackground(2, "spill")]
    state, effects = handle(state, LentBackgroundDone("spill", now=10.1, ran=False))
    assert effects == [PreemptBatchTurn(2)]
    assert [w.step_id for w in state.background] == ["spill"]
    state, effects = handle(state, BatchTurnDone(busy=True, ready=True, now=10.2, steps=1))
    assert effects == [RunBackgroundTurn("spill")]
    state, effects = handle(state, BackgroundTurnDone("spill", now=10.25))
    assert effects == [RunBatchTurn(3, 64)]
    # NOTE: the next turn lends again.
    state, effects = handle(state, WantBackgroundTurn("clone", now=10.3))
    assert effects == [LendBackground(3, "clone")]


def test_lending_keeps_background_within_its_share_and_never_cuts_a_chain() -> None:
    """Sustained batch load, an asker that asks again at once: no chain is cut, background time stays within the share bound and reaches half of it."""
    state = _lending_state()
    fg_step, bg_step = 0.02, 0.002
    now = bg_s = fg_s = 0.0
    cuts = 0
    asked = 0

    def feed(event: CoreEvent) -> list[Effect]:
        nonlocal state
        state, effects = handle(state, event)
        return effects

    effects = feed(BatchStatus(busy=True, ready=True, now=0.0))
    effects += feed(WantBackgroundTurn("bg-0", now=0.0))
    while now < 60.0:
        grants = [e for e in effects if isinstance(e, RunBatchTurn)]
        assert not any(isinstance(e, RunBackgroundTurn) for e in effects)
        (grant,) = grants
        lent = [e for e in effects if isinstance(e, LendBackground)]
        effects = []
        steps = 0
        while steps < grant.max_steps:
            cuts += any(isinstance(e, PreemptBatchTurn) for e in effects)
            now += fg_step
            fg_s += fg_step
            steps += 1
            lent += [e for e in effects if isinstance(e, LendBackground)]
            effects = []
            # NOTE: the chain runs what was lent during its step, then asks again.
            for e in lent:
                assert e.turn == grant.turn
                now += bg_step
                bg_s += bg_step
                effects += feed(LentBackgroundDone(e.step_id, now=now, ran=True, held_s=bg_step))
                asked += 1
                effects += feed(WantBackgroundTurn(f"bg-{asked}", now=now))
            lent = []
        effects += feed(BatchTurnDone(busy=True, ready=True, now=now, steps=steps))
    assert cuts == 0
    assert state.stats.batch_preempted == 0
    ratio = DEFAULT_BACKGROUND_SHARE / (1 - DEFAULT_BACKGROUND_SHARE)
    assert bg_s <= ratio * fg_s + state.background_credit_cap_s + bg_step
    assert bg_s >= 0.5 * ratio * fg_s
    assert state.stats.background_in_chain == asked
