"""vLLM's KV-event wire format: the msgpack payload of one ``KVEventBatch``.

Two encodings of the same structs (``vllm/distributed/kv_events.py``):

- ``array`` (the default; vLLM up to 0.23, and what Dynamo's and llm-d's
  decoders read): msgspec ``array_like`` structs. A batch is
  ``[ts, [event, ...], data_parallel_rank]``; an event is a tagged array
  whose first item is the class name:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]``.
- ``map`` (vLLM after its PR 42892): the same fields by name, the tag under
  ``"type"``; the batch is ``{"ts", "events", "data_parallel_rank"}``.

NOTE: fields with defaults in vLLM's structs (``extra_keys``,
``group_idx``, ...) are omitted, as its ``omit_defaults`` encoder omits
them; ``lora_name`` has no default in newer versions, so it is always
sent (older decoders ignore a trailing extra item). Block hashes are
unsigned 64-bit integers (vLLM's ``ExternalBlockHash`` as ints).

The transport around the payload: ZMQ PUB multipart
``[topic, seq (8 bytes big-endian), payload]``; a replay answer on the
ROUTER socket is ``[identity, b"", seq, payload]`` per buffered batch, then
``[identity, b"", -1 (8 bytes, signed), b""]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "END_SEQ",
    "AllCleared",
    "Removed",
    "Stored",
    "WireEvent",
    "WireFormat",
    "encode_batch",
    "seq_bytes",
]

WireFormat = Literal["array", "map"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay marker (vLLM's ``END_SEQ``)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """``BlockStored``: a chain of blocks appeared in ``medium``."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str


@dataclass(frozen=True, slots=True)
class Removed:
    """``BlockRemoved``: blocks left ``medium``."""

    block_hashes: tuple[int, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class AllCleared:
    """``AllBlocksCleared``: forget every block this publisher announced before."""


WireEvent = Stored | Removed | AllCleared


def _array(event: WireEvent) -> list[Any]:
    match event:
        case Stored():
            return [
                "BlockStored",
                list(event.block_hashes),
                event.parent_block_hash,
                list(event.token_ids),
                event.block_size,
                None,  # lora_id
                event.medium,
                None,  # lora_name
            ]
        case Removed():
            return ["BlockRemoved", list(event.block_hashes), event.medium]
        case AllCleared():
            return ["AllBlocksCleared"]


def _map(event: WireEvent) -> dict[str, Any]:
    match event:
        case Stored():
            return {
                "type": "BlockStored",
                "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash,
                "token_ids": list(event.token_ids),
                "block_size": event.block_size,
                "lora_id": None,
                "medium": event.medium,
                "lora_name": None,
            }
        case Removed():
            return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes),
                    "medium": event.medium}
        case AllCleared():
            return {"type": "AllBlocksCleared"}


def encode_batch(
    ts: float, events: list[WireEvent], *, data_parallel_rank: int = 0, fmt: WireFormat = "array"
) -> bytes:
    """The msgpack payload of one ``KVEventBatch`` (needs the ``cluster`` extra: msgspec)."""
    import msgspec  # NOTE: lazy: kvtier without the cluster extra never gets here.

    batch: Any
    if fmt == "array":
        batch = [ts, [_array(e) for e in events], data_parallel_rank]
    else:
        batch = {"ts": ts, "events": [_map(e) for e in events],
                 "data_parallel_rank": data_parallel_rank}
    return msgspec.msgpack.encode(batch)


def seq_bytes(seq: int) -> bytes:
    """A batch's sequence number as sent: 8 bytes, big-endian."""
    return seq.to_bytes(8, "big")
