"""The spill queue's rules for generation checkpoints: own byte share, newest per key, completion's removal."""

from __future__ import annotations

from actors.spill_queue import core
from messages import CheckpointRecord, Enqueue, EntryMeta, RemoveCheckpoints
from tests.actors.spill_queue.test_core import enqueue, env, released, sent

KEY_A = "a" * 32
KEY_B = "b" * 32


def ckpt(handle: str, nbytes: int, key: str = KEY_A, emitted: int = 1) -> Enqueue:
    """A checkpoint item of a 2-token prompt and ``emitted`` tokens pinning ``nbytes``."""
    ntok = 2 + emitted
    meta = EntryMeta(offset=ntok, nbytes=nbytes, trimmable=True, min_reusable_offset=0)
    record = CheckpointRecord(request_key=key, prompt_len=2, pending_token=7, sample_index=emitted)
    return Enqueue(handle=handle, tokens=tuple(range(ntok)), meta=meta, source="checkpoint",
                   checkpoint=record)


def test_a_newer_checkpoint_of_a_key_supersedes_its_queued_older_one() -> None:
    """The queued older checkpoint of the same key is dropped (not the in-flight one, not other keys)."""
    state = core.QueueState(cap_bytes=1000, checkpoint_share=0.5)
    core.handle(state, env(ckpt("a1", 10)))           # in flight
    core.handle(state, env(ckpt("a2", 10, emitted=2)))
    core.handle(state, env(ckpt("b1", 10, key=KEY_B)))
    _, fx = core.handle(state, env(ckpt("a3", 10, emitted=3)))
    assert released(fx) == ["a2"]
    assert [i.handle for i in state.queued] == ["b1", "a3"]
    assert state.checkpoints_superseded == 1
    assert state.checkpoints_lost == 0


def test_checkpoints_and_prompt_spills_each_drop_only_their_own_class_over_their_share() -> None:
    """Over its share a class drops its own oldest queued item; the other class is untouched."""
    state = core.QueueState(cap_bytes=100, checkpoint_share=0.25)
    core.handle(state, env(enqueue("flying", 10)))
    core.handle(state, env(enqueue("p1", 30)))
    core.handle(state, env(ckpt("b1", 20, key=KEY_B)))
    _, fx = core.handle(state, env(ckpt("a1", 20)))
    # NOTE: checkpoints hold 40 > 25: the oldest checkpoint goes, the prompt spill stays.
    assert released(fx) == ["b1"]
    _, fx = core.handle(state, env(enqueue("p2", 40)))
    # NOTE: prompt spills hold 10 + 30 + 40 = 80 > 75: p1 goes, the checkpoint stays.
    assert released(fx) == ["p1"]
    assert [i.handle for i in state.queued] == ["a1", "p2"]
    assert state.checkpoints_lost == 1
    assert core.stats(state).pending_checkpoints == 1


def test_completion_drops_queued_checkpoints_and_asks_the_writer_to_remove_the_files() -> None:
    """RemoveCheckpoints releases the key's queued items and sends the removal after them."""
    state = core.QueueState(cap_bytes=1000, checkpoint_share=0.5)
    _, fx = core.handle(state, env(ckpt("a1", 10)))
    assert sent(fx) == ["a1"]
    core.handle(state, env(ckpt("a2", 10, emitted=2)))
    core.handle(state, env(ckpt("b1", 10, key=KEY_B)))
    _, fx = core.handle(state, env(RemoveCheckpoints(request_key=KEY_A)))
    assert released(fx) == ["a2"]
    removals = [e for e in fx if isinstance(e, core.SendRemoveCheckpoints)]
    assert removals == [core.SendRemoveCheckpoints(KEY_A)]
    assert [i.handle for i in state.queued] == ["b1"]
    assert state.in_flight is not None
    assert state.in_flight.handle == "a1"


def test_a_checkpoint_item_without_its_record_is_failed_and_released() -> None:
    """source=checkpoint needs the record (and the record needs the source): else invalid."""
    state = core.QueueState(cap_bytes=1000)
    bad = enqueue("x", 10, source="checkpoint")
    _, fx = core.handle(state, env(bad))
    assert released(fx) == ["x"]
    assert state.failed == 1
    assert sent(fx) == []
