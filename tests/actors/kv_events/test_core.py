"""The KV-event publisher's rules: block identity, vLLM's wire format, block counts, replay."""

from __future__ import annotations

import hashlib
import struct

import pytest

from actors.kv_events import block_digests, core, external_hash, namespace_root
from actors.kv_events.wire import END_SEQ
from messages.kv_events import (
    BlockIndexRequest,
    KvEventsReplay,
    Medium,
    TierChange,
    TierChanged,
)
from tests.actors.kv_events.vllm_structs import (
    ARRAY_DECODER,
    MAP_DECODER,
    AllBlocksCleared,
    BlockIndexMirror,
    BlockRemoved,
    BlockStored,
    MapBlockStored,
)

MODEL, SCHEME = "m", "kv:plain"


def _state(**kw: object) -> core.CoreState:
    return core.CoreState(model=MODEL, kv_scheme=SCHEME, **kw)  # type: ignore[arg-type]


def _change(medium: Medium, *changes: tuple[str, tuple[int, ...]], ns: str = "") -> core.Received:
    body = TierChanged(
        medium=medium,
        changes=tuple(TierChange(op=op, namespace=ns, tokens=t) for op, t in changes),  # type: ignore[arg-type]
    )
    return core.Received(body, ts=123.5)


def _publish(effects: list[core.Effect]) -> list[core.Publish]:
    return [e for e in effects if isinstance(e, core.Publish)]


def _decode(effects: list[core.Effect]) -> list[object]:
    return [ev for p in _publish(effects) for ev in ARRAY_DECODER.decode(p.frames[2]).events]


def test_golden_block_hashes() -> None:
    """The namespace root and chained block hashes equal values computed once and written here."""
    root = namespace_root(model="m", kv_scheme="kv:plain", namespace="")
    assert root.hex() == "36d147032a7a709e65ea424c48d2d01c86c4eed160627552accd1fba941fe95e"
    digests = block_digests(root, list(range(40)))
    assert [d.hex() for d in digests] == [
        "9a03527d5462811d7266b61253d2710f8d390c61c9bc606cf7f8007b894141c4",
        "5a412bdcfad58c8f87528ff700ef860e3b25c9d0d9fa934a5e28faa6dda3b80f",
    ]
    assert [external_hash(d) for d in digests] == [17868032052176175556, 6784948433223661583]
    salted = namespace_root(model="m", kv_scheme="kv:plain", namespace="#iso:abc")
    assert salted.hex() == "018fc879e89e9c5200b8866f4fd8b354617377913406d0ab802d9c04566e9d61"


def test_block_hash_follows_its_written_definition() -> None:
    """Each digest is SHA-256(parent digest || 16 ids as 4-byte big-endian), rooted in the namespace."""
    root = namespace_root(model="x", kv_scheme="kv:q8", namespace="ns")
    parts = b"".join(len(v).to_bytes(4, "big") + v for v in (b"x", b"kv:q8", b"ns"))
    assert root == hashlib.sha256(b"kvtier.block-root.v1\x00" + parts).digest()
    tokens = [7, 70000, 3, 2**32 - 1] * 8
    first = hashlib.sha256(root + struct.pack(">16I", *tokens[:16])).digest()
    second = hashlib.sha256(first + struct.pack(">16I", *tokens[16:32])).digest()
    assert block_digests(root, [*tokens, 1, 2, 3]) == [first, second]
    assert block_digests(root, tokens, start=1) == [second]


def test_namespace_parts_separate_hashes() -> None:
    """A different model, KV scheme or cache namespace (salt) gives different block hashes."""
    tokens = list(range(16))
    base = block_digests(namespace_root(model="m", kv_scheme="s", namespace=""), tokens)
    for kw in ({"model": "m2", "kv_scheme": "s", "namespace": ""},
               {"model": "m", "kv_scheme": "s2", "namespace": ""},
               {"model": "m", "kv_scheme": "s", "namespace": "#iso:1"}):
        assert block_digests(namespace_root(**kw), tokens) != base


def test_token_ids_out_of_range_refused() -> None:
    """Token ids outside [0, 2**32) raise instead of hashing to something ambiguous."""
    root = namespace_root(model="m", kv_scheme="s", namespace="")
    with pytest.raises(ValueError):
        block_digests(root, [-1] + [0] * 15)
    with pytest.raises(ValueError):
        block_digests(root, [2**32] + [0] * 15)


def test_first_batch_is_all_blocks_cleared() -> None:
    """A fresh publisher's seq 0 is AllBlocksCleared; a restarted shell does not clear again."""
    state = _state()
    state, effects = core.handle(state, core.Started(ts=1.0))
    (pub,) = _publish(effects)
    assert pub.seq == 0
    assert pub.frames[1] == (0).to_bytes(8, "big")
    batch = ARRAY_DECODER.decode(pub.frames[2])
    assert batch.ts == 1.0
    assert batch.data_parallel_rank == 0
    assert [type(e) for e in batch.events] == [AllBlocksCleared]
    _, again = core.handle(state, core.Started(ts=2.0))
    assert again == []


def test_stored_entry_is_one_chain_vllm_decodes() -> None:
    """An entry of 40 tokens is one BlockStored of its 2 full blocks (parent None, 32 token ids)."""
    state = _state()
    tokens = tuple(range(100, 140))
    _, effects = core.handle(state, _change("CPU", ("stored", tokens)))
    (ev,) = _decode(effects)
    assert isinstance(ev, BlockStored)
    root = namespace_root(model=MODEL, kv_scheme=SCHEME, namespace="")
    assert ev.block_hashes == [external_hash(d) for d in block_digests(root, tokens)]
    assert ev.parent_block_hash is None
    assert ev.token_ids == list(tokens[:32])
    assert ev.block_size == 16
    assert ev.medium == "CPU"
    assert ev.lora_id is None
    assert ev.lora_name is None


def test_map_format_decodes_with_vllm_map_structs() -> None:
    """The ``map`` wire format decodes with vLLM's map-encoded structs to the same fields."""
    state = _state(wire_format="map")
    _, effects = core.handle(state, _change("DISK", ("stored", tuple(range(32)))))
    (pub,) = _publish(effects)
    (ev,) = MAP_DECODER.decode(pub.frames[2]).events
    assert isinstance(ev, MapBlockStored)
    assert len(ev.block_hashes) == 2
    assert ev.medium == "DISK"
    assert ev.token_ids == list(range(32))


def test_shared_prefix_counts_blocks_once() -> None:
    """A second entry sharing a prefix announces only its new blocks, parented on the shared one;
    a block leaves only with the last entry holding it."""
    state = _state()
    a = tuple(range(48))  # 3 blocks
    b = a[:32] + tuple(range(900, 932))  # shares 2 blocks, adds 2
    _, first = core.handle(state, _change("CPU", ("stored", a)))
    _, second = core.handle(state, _change("CPU", ("stored", b)))
    (ev_a,) = _decode(first)
    (ev_b,) = _decode(second)
    assert isinstance(ev_a, BlockStored)
    assert isinstance(ev_b, BlockStored)
    assert ev_b.parent_block_hash == ev_a.block_hashes[1]
    assert len(ev_b.block_hashes) == 2
    assert ev_b.token_ids == list(b[32:])
    _, removal = core.handle(state, _change("CPU", ("removed", a)))
    (gone,) = _decode(removal)
    assert isinstance(gone, BlockRemoved)
    assert gone.block_hashes == [ev_a.block_hashes[2]]
    _, last = core.handle(state, _change("CPU", ("removed", b)))
    (gone_b,) = _decode(last)
    assert isinstance(gone_b, BlockRemoved)
    assert sorted(gone_b.block_hashes) == sorted(ev_a.block_hashes[:2] + ev_b.block_hashes)
    assert core.stats(state).blocks_cpu == 0


def test_media_are_counted_apart() -> None:
    """The same entry in RAM and on disk is two sets of blocks; removing one keeps the other."""
    state = _state()
    t = tuple(range(16))
    core.handle(state, _change("CPU", ("stored", t)))
    _, disk = core.handle(state, _change("DISK", ("stored", t)))
    assert len(_decode(disk)) == 1
    _, effects = core.handle(state, _change("CPU", ("removed", t)))
    (ev,) = _decode(effects)
    assert isinstance(ev, BlockRemoved)
    assert ev.medium == "CPU"
    index = core.block_index(state)
    assert index.cpu == ()
    assert len(index.disk) == 1


def test_net_change_only_within_one_message() -> None:
    """A block that leaves and returns in one message (a rewrite of the same file) is not announced."""
    state = _state()
    t = tuple(range(32))
    core.handle(state, _change("DISK", ("stored", t)))
    _, effects = core.handle(state, _change("DISK", ("removed", t), ("stored", t)))
    assert _publish(effects) == []
    assert core.stats(state).next_seq == 1


def test_short_entries_and_unknown_removals_publish_nothing() -> None:
    """An entry under one block, and a removal of a block never stored, change nothing."""
    state = _state()
    _, effects = core.handle(state, _change("CPU", ("stored", tuple(range(15)))))
    assert effects == []
    _, effects = core.handle(state, _change("CPU", ("removed", tuple(range(64)))))
    assert effects == []
    assert core.stats(state).blocks_cpu == 0


def test_replay_sends_buffered_batches_from_seq_then_end_marker() -> None:
    """A replay request gets every buffered batch with seq >= start, then vLLM's END_SEQ frame."""
    state = _state(buffer_steps=2)
    core.handle(state, core.Started(ts=0.0))
    for i in range(3):
        core.handle(state, _change("CPU", ("stored", tuple(range(i * 100, i * 100 + 16)))))
    # NOTE: 4 batches published, 2 kept: seq 2 and 3.
    _, effects = core.handle(state, core.Received(KvEventsReplay(client="0a0b", start_seq=1), 0.0))
    (rep,) = effects
    assert isinstance(rep, core.SendReplay)
    assert rep.client == b"\x0a\x0b"
    seqs = [int.from_bytes(f[2], "big", signed=True) for f in rep.frames]
    assert seqs == [2, 3, -1]
    assert rep.frames[-1] == (b"\x0a\x0b", b"", END_SEQ, b"")
    assert all(f[1] == b"" for f in rep.frames)


def test_mirror_equals_block_index_after_mixed_changes() -> None:
    """A subscriber applying every batch ends with exactly the publisher's block index."""
    state = _state()
    mirror = BlockIndexMirror()
    entries = [tuple(range(k, k + n)) for k, n in ((0, 64), (0, 40), (5, 33), (0, 16))]
    script = [("CPU", "stored", e) for e in entries] + [
        ("DISK", "stored", entries[0]), ("CPU", "removed", entries[0]),
        ("CPU", "removed", entries[2]), ("DISK", "stored", entries[2]),
    ]
    events: list[core.Effect] = []
    _, started = core.handle(state, core.Started(ts=0.0))
    events += started
    for medium, op, tokens in script:
        _, eff = core.handle(state, _change(medium, (op, tokens)))  # type: ignore[arg-type]
        events += eff
    for pub in _publish(events):
        mirror.apply(ARRAY_DECODER.decode(pub.frames[2]))
    index = core.block_index(state)
    assert sorted(mirror.blocks["CPU"]) == list(index.cpu)
    assert sorted(mirror.blocks["DISK"]) == list(index.disk)
    _, reply = core.handle(state, core.Received(BlockIndexRequest(), 0.0))
    assert reply == [core.Reply(index)]
