"""The batch scheduler core's generation-checkpoint rules, by plain calls.

A keyed row looks its checkpoint up at admission, beside its prompt-cache
lookup (and never inside a step), and is ready once both answered; a found
checkpoint makes the row join from it and gives the prompt cache's lease
back; snapshots go to the spill queue
(freed when their row is gone); a finished answer voids its checkpoints,
a cancel keeps them.
"""

from __future__ import annotations

from actors.batch_scheduler.core import (
    Admit,
    Cancel,
    CheckpointLoaded,
    Effect,
    ExitOut,
    LoadCheckpoint,
    LookupAnswered,
    ReleaseLease,
    Resumed,
    SendCheckpoint,
    StartLookup,
    StepFinished,
    StepOut,
    SubmitStep,
    TokenOut,
    VoidCheckpoints,
)
from actors.checkpoints import Captured
from messages.prompt_cache import TakeResult
from tests.actors.batch_scheduler.test_core import Core, gen, of, reg


def _cap(handle: str = "h1") -> Captured:
    r = reg(handle, tuple(range(1, 13)))
    return Captured(r.handle, r.meta, r.tokens, prompt_len=8, pending_token=5, rng_key=None)


def _phase(core: Core, rid: str) -> str:
    """The row's phase (a plain ``str``: successive checks of one row are not narrowed)."""
    return core.state.rows[rid].phase


def _admit(core: Core, rid: str, key: str | None) -> list[Effect]:
    return core.handle(Admit(gen(rid), f"c-{rid}", 0.0, key))


def test_keyed_row_looks_its_checkpoint_up_beside_the_prompt_cache() -> None:
    """LoadCheckpoint and the Take both at admission; the row is ready only once both answered, in either order."""
    for first in ("checkpoint", "take"):
        core = Core(lookups=True)
        effects = _admit(core, "a", "k" * 32)
        (load,) = of(effects, LoadCheckpoint)
        assert load.key == "k" * 32
        assert len(of(effects, StartLookup)) == 1
        hit = TakeResult(lease_id="L1", handle="h1", cached_tokens=5, entry_tokens=6)
        answers: list[CheckpointLoaded | LookupAnswered] = [
            CheckpointLoaded("a", False, 0.1), LookupAnswered("a", hit, 0.2)]
        if first == "take":
            answers = [LookupAnswered("a", hit, 0.1), CheckpointLoaded("a", False, 0.2)]
        effects = core.handle(answers[0])
        assert not of(effects, StartLookup)
        assert _phase(core, "a") == "lookup", f"{first} alone does not make it ready"
        effects = core.handle(answers[1])
        assert not of(effects, ReleaseLease)
        assert _phase(core, "a") == "ready"
        assert core.state.rows["a"].lookup_done_at == 0.2
        (submit,) = of(core.grant(), SubmitStep)
        (join,) = submit.joins
        assert (join.handle, join.cached_tokens, join.resume) == ("h1", 5, None)


def test_unkeyed_row_takes_no_checkpoint_lookup() -> None:
    """A row without a key goes straight to the prompt-cache lookup, and joins with checkpoint=False."""
    core = Core(lookups=False)
    effects = _admit(core, "a", None)
    assert not of(effects, LoadCheckpoint)
    (submit,) = of(core.grant(), SubmitStep)
    assert submit.joins[0].checkpoint is False
    assert submit.joins[0].resume is None


def test_keyed_row_without_checkpoint_or_prompt_cache_joins_fresh() -> None:
    """No checkpoint found and no prompt cache: the row joins with checkpoints on and nothing to resume."""
    core = Core(lookups=False)
    _admit(core, "a", "k" * 32)
    core.handle(CheckpointLoaded("a", False, 0.1))
    (submit,) = of(core.grant(), SubmitStep)
    (join,) = submit.joins
    assert join.checkpoint is True
    assert join.resume is None


def test_found_checkpoint_joins_resumed_and_gives_the_lease_back() -> None:
    """A found checkpoint: the row joins resumed once its Take answered too, and the Take's lease goes back."""
    core = Core(lookups=True)
    _admit(core, "a", "k" * 32)
    effects = core.handle(CheckpointLoaded("a", True, 0.1))
    assert not of(effects, StartLookup)
    assert _phase(core, "a") == "lookup", "its Take has not answered yet"
    hit = TakeResult(lease_id="L1", handle="h1", cached_tokens=5, entry_tokens=6)
    effects = core.handle(LookupAnswered("a", hit, 0.2))
    assert of(effects, ReleaseLease) == [ReleaseLease("L1")]
    assert _phase(core, "a") == "ready"
    (submit,) = of(core.grant(), SubmitStep)
    (join,) = submit.joins
    assert join.resume is True
    assert join.checkpoint is True
    assert join.handle is None
    assert join.staging_id is None
    step = StepOut(joined=(("a", 8),), resumed=(("a", 16),))
    effects = core.handle(StepFinished(core.turn, step, 1.0, last=False))
    assert of(effects, Resumed) == [Resumed("a", 16, 8)]
    assert core.state.stats.checkpoints_resumed == 1


def test_found_checkpoint_without_prompt_cache_joins_at_once() -> None:
    """No prompt cache: a found checkpoint alone makes the row ready; nothing to give back."""
    core = Core(lookups=False)
    _admit(core, "a", "k" * 32)
    effects = core.handle(CheckpointLoaded("a", True, 0.1))
    assert not of(effects, ReleaseLease)
    assert _phase(core, "a") == "ready"
    (submit,) = of(core.grant(), SubmitStep)
    assert submit.joins[0].resume is True


def test_snapshots_go_out_and_completion_voids_the_key() -> None:
    """Each snapshot is a SendCheckpoint with the row's key; a stop exit voids the key."""
    core = Core()
    _admit(core, "a", "k" * 32)
    core.handle(CheckpointLoaded("a", False, 0.1))
    core.grant()
    step = StepOut(tokens=(TokenOut("a", 0, 7, "x"),), checkpoints=(("a", _cap()),))
    effects = core.handle(StepFinished(core.turn, step, 1.0, last=False))
    (send,) = of(effects, SendCheckpoint)
    assert send.key == "k" * 32
    assert send.captured.handle == "h1"
    done = StepOut(tokens=(TokenOut("a", 1, 8, "y", finish_reason="stop"),),
                   exits=(ExitOut("a", "stop", 2),))
    effects = core.handle(StepFinished(core.turn, done, 2.0))
    assert of(effects, VoidCheckpoints) == [VoidCheckpoints("k" * 32)]


def test_cancel_keeps_checkpoints_and_a_gone_rows_snapshot_is_freed() -> None:
    """A cancelled answer sends no VoidCheckpoints; a snapshot whose row left goes out without a key."""
    core = Core()
    _admit(core, "a", "k" * 32)
    core.handle(CheckpointLoaded("a", False, 0.1))
    core.grant()
    step = StepOut(tokens=(TokenOut("a", 0, 7, "x"),), checkpoints=(("a", _cap()),))
    core.handle(StepFinished(core.turn, step, 1.0, last=False))
    core.handle(Cancel("a", 1.5))
    gone = StepOut(exits=(ExitOut("a", "cancelled", 1),), checkpoints=(("zz", _cap("h2")),))
    effects = core.handle(StepFinished(core.turn, gone, 2.0))
    assert not of(effects, VoidCheckpoints)
    (send,) = of(effects, SendCheckpoint)
    assert send.key is None
    assert send.captured.handle == "h2"


def test_finished_answer_without_checkpoints_voids_nothing() -> None:
    """An answer that ended before its first checkpoint (none found, none sent) sends no VoidCheckpoints."""
    core = Core()
    _admit(core, "a", "k" * 32)
    core.handle(CheckpointLoaded("a", False, 0.1))
    core.grant()
    done = StepOut(tokens=(TokenOut("a", 0, 8, "y", finish_reason="length"),),
                   exits=(ExitOut("a", "length", 1),))
    effects = core.handle(StepFinished(core.turn, done, 2.0))
    assert not of(effects, VoidCheckpoints)


def test_lookup_answer_for_a_row_gone_is_dropped() -> None:
    """A row cancelled while its lookups ran: the late checkpoint answer changes nothing, the late lease goes back."""
    core = Core(lookups=True)
    _admit(core, "a", "k" * 32)
    core.handle(Cancel("a", 0.05))
    effects = core.handle(CheckpointLoaded("a", True, 0.1))
    assert "a" not in core.state.rows
    assert not of(effects, SubmitStep)
    effects = core.handle(LookupAnswered("a", TakeResult(lease_id="L1", handle="h1", cached_tokens=5), 0.2))
    assert of(effects, ReleaseLease) == [ReleaseLease("L1")]
    assert not of(effects, SubmitStep)
