"""Tensor-parallel serving under ``mlx.launch``: rank 0 serves and drives, the other ranks follow.

``protocol``: the commands; ``leader``: rank 0's mirrored backend;
``follower``: the other ranks' command loop; ``launch``: the group, loading
a shard, and the entry points ``kvtier serve`` calls (docs/tensor-parallel.md).
"""

from __future__ import annotations

from .follower import Follower, OutOfStep, Receiver, follow
from .launch import (
    follower_rank,
    group,
    lead,
    load_shard,
    rank_and_size,
    release_followers,
    run_follower,
    stop_followers,
)
from .leader import LeaderBackend, Sender, TensorParallelUnsupported, seeded
from .protocol import Op, decode_handles, decode_open, encode_handles, encode_open

__all__ = [
    "Follower",
    "LeaderBackend",
    "Op",
    "OutOfStep",
    "Receiver",
    "Sender",
    "TensorParallelUnsupported",
    "decode_handles",
    "decode_open",
    "encode_handles",
    "encode_open",
    "follow",
    "follower_rank",
    "group",
    "lead",
    "load_shard",
    "rank_and_size",
    "release_followers",
    "run_follower",
    "seeded",
    "stop_followers",
]
