"""KV events in vLLM's format: what the RAM and SSD tiers hold, as chained block hashes.

``block_hash`` defines stable block identity (pure Python), ``wire`` the
msgpack encoding, ``core`` the rules (sans-IO), ``actor`` the shell,
``ports`` the ZeroMQ sockets (the ``cluster`` extra). See ``docs/scale-out.md``.
"""

from __future__ import annotations

from . import core
from .actor import KV_EVENTS_ADDRESS, KvEvents
from .block_hash import BLOCK_SIZE, HASH_SCHEME, block_digests, external_hash, namespace_root
from .core import CoreState
from .ports import EventSockets, ZmqSockets, check_endpoint
from .wire import WireFormat, encode_batch

__all__ = [
    "BLOCK_SIZE",
    "HASH_SCHEME",
    "KV_EVENTS_ADDRESS",
    "CoreState",
    "EventSockets",
    "KvEvents",
    "WireFormat",
    "ZmqSockets",
    "block_digests",
    "check_endpoint",
    "core",
    "encode_batch",
    "external_hash",
    "namespace_root",
]
