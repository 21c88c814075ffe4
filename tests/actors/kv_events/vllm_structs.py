"""vLLM's KV-event structs, as ``vllm/distributed/kv_events.py`` defines them, for decoding in tests.

``Array*``: vLLM up to 0.23 (msgspec ``array_like`` tagged structs; field
order is the wire order). ``Map*``: vLLM after PR 42892 (the same fields by
name, tag under ``"type"``). Decoding a payload with
``msgspec.msgpack.Decoder(type=...)`` is what vLLM's own subscriber does.
"""

from __future__ import annotations

from typing import Any

import msgspec


class ArrayEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayKVCacheEvent(  # type: ignore[call-arg]
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True
):
    """Base class of vLLM's events (array-like)."""


class BlockStored(ArrayKVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(ArrayKVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(ArrayKVCacheEvent):
    pass


class ArrayKVEventBatch(ArrayEventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class MapEventBatch(msgspec.Struct, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class of vLLM's events (map-encoded)."""


class MapBlockStored(MapKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class MapBlockRemoved(MapKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(MapKVCacheEvent, tag="AllBlocksCleared"):
    pass


class MapKVEventBatch(MapEventBatch):
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]


ARRAY_DECODER = msgspec.msgpack.Decoder(type=ArrayKVEventBatch)
MAP_DECODER = msgspec.msgpack.Decoder(type=MapKVEventBatch)


class BlockIndexMirror:
    """A subscriber's view: the set of (medium, block hash) the events describe.

    Rebuilt only from decoded events (``apply``); ``AllBlocksCleared`` empties it.
    """

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {"CPU": set(), "DISK": set()}
        self.tokens: dict[int, tuple[int, ...]] = {}
        self.parents: dict[int, int | None] = {}

    def apply(self, batch: ArrayKVEventBatch | MapKVEventBatch) -> None:
        """Apply one decoded batch."""
        for ev in batch.events:
            if isinstance(ev, (BlockStored, MapBlockStored)):
                assert ev.medium is not None
                size = ev.block_size
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    assert isinstance(h, int)
                    self.blocks[ev.medium].add(h)
                    self.tokens[h] = tuple(ev.token_ids[i * size : (i + 1) * size])
                    self.parents[h] = parent if isinstance(parent, int) or parent is None else None
                    parent = h
            elif isinstance(ev, (BlockRemoved, MapBlockRemoved)):
                assert ev.medium is not None
                for h in ev.block_hashes:
                    assert isinstance(h, int)
                    self.blocks[ev.medium].discard(h)
            else:
                for s in self.blocks.values():
                    s.clear()
