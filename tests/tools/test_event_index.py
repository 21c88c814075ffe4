"""The event-driven router's rules: a block index fed by kvtier's own KV-event encoder, and the choice."""

from __future__ import annotations

import pytest

from actors.kv_events.block_hash import block_digests, external_hash, namespace_root
from actors.kv_events.wire import AllCleared, Removed, Stored, WireFormat, encode_batch
from tools.cluster._event_index import BlockIndex, choose, decode_payload

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


def test_choose_longest_prefix_then_least_loaded_then_turn() -> None:
    """The longest cached prefix wins even when busier; equal prefixes go to the least loaded;
    equal load rotates with the turn."""
    assert choose([3, 5], [0, 4], 0).replica == 1
    tie = choose([5, 5, 2], [2, 1, 0], 0)
    assert (tie.replica, tie.reason) == (1, "load")
    assert {choose([0, 0], [1, 1], t).replica for t in range(2)} == {0, 1}
    with pytest.raises(ValueError):
        choose([1], [0, 0], 0)
