"""``kvtier serve --tensor-parallel on`` under ``mlx.launch``: the group, rank 0's backend, the other ranks' loop.

Every rank runs the same ``kvtier serve`` command line. :func:`rank_and_size`
joins the ``mx.distributed`` group ``mlx.launch`` set up (ring on CPUs, NCCL
on CUDA). Rank 0 goes on to serve HTTP: its ``Engine`` loads its shard
(:func:`load_shard`) and wraps its backend in a ``LeaderBackend``
(:func:`lead`). Every other rank runs :func:`run_follower`: the same startup
forwards as rank 0's ``Engine.start``, then rank 0's commands until ``STOP``,
which rank 0 sends when it stops (:func:`stop_followers`).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import structlog

from actors.engine.config import EngineConfig

from .follower import Follower, follow
from .leader import LeaderBackend

__all__ = [
    "follower_rank",
    "group",
    "lead",
    "load_shard",
    "rank_and_size",
    "release_followers",
    "run_follower",
    "stop_followers",
]

_log = structlog.get_logger("kvtier.distributed")


def group() -> Any:
    """The process's ``mx.distributed`` group (joined on first call; engine thread).

    NOTE: ``backend="any"`` takes what ``mlx.launch`` set up (its ring
    hostfile or NCCL's variables); a process started without it is a group
    of one.
    """
    import mlx.core as mx

    return mx.distributed.init(strict=False, backend="any")


def rank_and_size() -> tuple[int, int]:
    """This process's rank and the group's size (engine thread)."""
    g = group()
    return int(g.rank()), int(g.size())


def load_shard(path: str | Path) -> Any:
    """This rank's shard of the model (``kernels.distributed.load_sharded``; engine thread, every rank at once)."""
    from kernels.distributed import load_sharded

    loaded = load_sharded(path, group())
    _log.info("tp.loaded", rank=int(group().rank()), size=int(group().size()),
              model=loaded.identity.name)
    return loaded


def lead(backend: Any, registry: Any) -> LeaderBackend:
    """Rank 0's backend: ``backend`` with every call mirrored to the other ranks (engine thread)."""
    from kernels.distributed import Channel

    return LeaderBackend(backend, Channel(group()), registry)


def stop_followers() -> None:
    """Rank 0, at shutdown: tell the other ranks to leave their loop (engine thread)."""
    from kernels.distributed import Channel, Command

    from .protocol import Op

    channel = Channel(group())
    if channel.size > 1:
        channel.send(Command(Op.STOP, 0))


def _startup(config: EngineConfig, path: str | Path) -> tuple[Any, Any]:
    """Load, then run the forwards rank 0's ``Engine.start`` runs, in its order (engine thread).

    NOTE: rank 0's KV-scheme check and memory-footprint probe each run one
    token through the sharded model; their ``all_sum`` need this rank's
    forwards too. Keep this sequence in step with ``Engine.start``.
    """
    import kernels
    from actors.backend import MlxBackend
    from actors.engine.memory import model_footprint
    from kernels.cache import UnsupportedCacheKind, check_kv_scheme

    loaded = load_shard(path)
    limit = config.mlx_cache_limit_bytes
    kernels.configure_mlx_memory(cache_limit_bytes="default" if limit is None else limit)
    scheme = kernels.resolve_kv_scheme(config.kv_quant, loaded.path, missing_config="error")
    check_kv_scheme(loaded.model, scheme)
    cap = config.prompt_cache_bytes
    if cap is None:
        cap = kernels.default_prompt_cache_bytes()
    registry = kernels.CacheRegistry() if cap > 0 else None
    backend = MlxBackend(loaded.model, loaded.tokenizer, prefill_step_size=config.prefill_step_size,
                         kv_scheme=scheme, registry=registry)
    try:
        model_footprint(loaded.model, scheme, config.prefill_step_size)
    except (UnsupportedCacheKind, ValueError):
        pass  # NOTE: rank 0 serves without its memory guard then; the forward ran the same.
    return backend, registry


def _follow_rank_zero(follower: Follower) -> int:
    from kernels.distributed import Channel

    channel = Channel(group())
    _log.info("tp.following", rank=channel.rank, size=channel.size)
    return follow(channel, follower)


def run_follower(config: EngineConfig, path: str | Path) -> int:
    """A rank other than 0: load the shard, follow rank 0 until it stops; the exit status."""
    from kernels import EngineThread

    # NOTE: a Ctrl-C reaches every rank of mlx.launch's process group; rank 0
    # drains and then sends STOP, so this rank waits for it instead of leaving
    # rank 0's collectives without a partner. SIGTERM still ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    thread = EngineThread(name="kvtier-engine", max_queue=4)
    try:
        backend, registry = thread.sync_run(_startup, config, path)
        thread.sync_run(_follow_rank_zero, Follower(backend, registry))
    finally:
        thread.close()
    return 0


def follower_rank(config: EngineConfig, path: str | Path) -> int | None:
    """``None`` on rank 0 (it goes on to serve); on any other rank, follow rank 0 and return the exit status."""
    from kernels import EngineThread

    with EngineThread(name="kvtier-engine", max_queue=4) as thread:
        rank, size = thread.sync_run(rank_and_size)
    if rank == 0:
        if size == 1:
            _log.warning("tp.single_rank", reason="not started by mlx.launch (or -n 1): "
                         "the model loads whole, through the tensor-parallel path")
        return None
    return run_follower(config, path)


async def release_followers() -> None:
    """Rank 0, after its ``Engine`` closed: send ``STOP`` to the other ranks."""
    from kernels import EngineThread

    async with EngineThread(name="kvtier-engine", max_queue=4) as thread:
        await thread.run(stop_followers)
