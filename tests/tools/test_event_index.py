"""The event-driven router's rules: a block index fed by kvtier's own KV-event encoder, and the choice."""

from __future__ import annotations

import pytest

from actors.kv_events.block_hash import block_digests, external_hash, namespace_root
from actors.kv_events.wire import AllCleared, Removed, Stored, WireFormat, encode_batch
from tools.cluster._event_index import BlockIndex, Predicted, choose, decode_payload

ROOT = namespace_root(model="m", kv_scheme="bf16", namespace="")
TOKENS = list(range(100, 100 + 16 * 6))
CHAIN = [external_hash(d) for d in block_digests(ROOT, TOKENS)]


def _stored(hashes: list[int], medium: str) -> Stored:
    return Stored(tuple(hashes), None, tuple(TOKENS[: 16 * len(hashes)]), 16, medium)


@pytest.mark.parametrize("fmt", ["array", "map"])
def test_index_follows_stored_removed_and_cleared_batches(fmt: WireFormat) -> None:
    """Stored blocks count as a cached prefix; a block leaves only when its last medium removes it;
    AllBlocksCleared forgets everything; both wire formats decode the same."""
    idx = BlockIndex()
    idx.apply(decode_payload(encode_batch(1.0, [_stored(CHAIN[:4], "CPU")], fmt=fmt)))
    assert idx.cached_blocks(CHAIN) == 4
    idx.apply(decode_payload(encode_batch(2.0, [_stored(CHAIN[:2], "DISK")], fmt=fmt)))
    idx.apply(decode_payload(encode_batch(3.0, [Removed(tuple(CHAIN[:4]), "CPU")], fmt=fmt)))
    assert idx.cached_blocks(CHAIN) == 2  # the DISK copy of blocks 0-1 remains
    assert idx.cached_blocks(CHAIN[:1]) == 1
    idx.apply(decode_payload(encode_batch(4.0, [AllCleared()], fmt=fmt)))
    assert idx.cached_blocks(CHAIN) == 0
    assert idx.held == {}


def test_a_different_namespace_shares_no_prefix() -> None:
    """A salted request's chain (another namespace root) matches nothing an unsalted entry stored."""
    idx = BlockIndex()
    idx.apply(decode_payload(encode_batch(1.0, [_stored(CHAIN, "CPU")])))
    salted = namespace_root(model="m", kv_scheme="bf16", namespace="#iso:x")
    other = [external_hash(d) for d in block_digests(salted, TOKENS)]
    assert idx.cached_blocks(other) == 0
    assert idx.cached_blocks([*CHAIN[:3], 12345]) == 3


def test_choose_least_prefill_then_least_loaded_then_turn() -> None:
    """Rule prefill: a longer cached prefix wins even on a busier replica while its queue costs
    less than the prefix saves; a longer queue than that spills to the other replica; equal costs
    go to the least loaded, then rotate with the turn."""
    # 8-block request: replica 1 holds 5 blocks, 2 queued -> 5 < 8 on the idle replica 0.
    assert choose(8, [0, 5], [0, 2], [0, 4], 0, rule="prefill").replica == 1
    # the same prefix behind 6 queued blocks costs 9 > 8: spill to the cold replica.
    spill = choose(8, [0, 5], [0, 6], [0, 1], 0, rule="prefill")
    assert (spill.replica, spill.reason, spill.cached_blocks) == (0, "cost", 0)
    tie = choose(8, [5, 5, 2], [0, 0, 0], [2, 1, 0], 0, rule="prefill")
    assert (tie.replica, tie.reason) == (1, "load")
    assert {choose(4, [0, 0], [0, 0], [1, 1], t, rule="prefill").replica for t in range(2)} == {0, 1}
    with pytest.raises(ValueError):
        choose(1, [1], [0, 0], [0, 0], 0)
    with pytest.raises(ValueError):
        choose(1, [1], [0], [0], 0, rule="fastest")


def test_choose_by_prefix_ignores_queued_work_and_leaves_load_to_the_balance_rule() -> None:
    """Rule prefix (the default): the prefix behind 6 queued blocks still wins (load is the balance
    rule's), ties still go to the least loaded, and an imbalance still moves the request."""
    home = choose(8, [0, 5], [0, 6], [0, 1], 0)
    assert (home.replica, home.reason, home.cached_blocks) == (1, "cost", 5)
    tie = choose(8, [5, 5, 2], [9, 0, 0], [2, 1, 0], 0)
    assert (tie.replica, tie.reason) == (1, "load")
    moved = choose(8, [0, 5], [0, 0], [0, 3], 0, abs_threshold=2, rel_threshold=1.5)
    assert (moved.replica, moved.reason) == (0, "balance")


def test_predicted_chains_count_while_in_flight_then_until_their_deadline() -> None:
    """A routed chain is held while in flight, until its deadline after it ends, then forgotten;
    a shorter request's chain predicts only its own prefix."""
    pred = Predicted()
    pred.add(CHAIN[:3])
    assert pred.cached_blocks(CHAIN, now=1e9) == 3  # in flight: no deadline
    pred.settle(CHAIN[:3], until=10.0)
    assert pred.cached_blocks(CHAIN, now=9.0) == 3
    pred.expire(now=9.0)
    assert pred.cached_blocks(CHAIN, now=10.5) == 0
    pred.expire(now=10.5)
    assert pred.until == {}
