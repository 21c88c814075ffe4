"""Tensor parallelism over ``mx.distributed``: sharded loading and rank 0's command channel."""

from __future__ import annotations

from ._channel import HEADER_WORDS, MAX_PAYLOAD_BYTES, Channel, ChannelError, Command
from ._sharded import NotShardable, check_shardable, load_sharded

__all__ = [
    "HEADER_WORDS",
    "MAX_PAYLOAD_BYTES",
    "Channel",
    "ChannelError",
    "Command",
    "NotShardable",
    "check_shardable",
    "load_sharded",
]
