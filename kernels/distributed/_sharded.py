"""Tensor-parallel loading: each rank of an ``mx.distributed`` group loads its shard of a model.

``load_sharded`` wraps mlx-lm's ``sharded_load`` (the model's ``shard()``
splits every attention and MLP projection over the group; the sharded layers
``all_sum`` their partial outputs, so every rank must run every forward) and
adds kvtier's ``ModelIdentity``. kvtier's CPU forward transforms (fused
projections, the few-row product) are not applied: they replace the layers
``shard()`` splits.

NOTE: blocking MLX work and collectives; call it on the engine thread, on
every rank of the group at the same time (``sharded_load`` ends in a barrier).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kernels.model import LoadedModel, ModelLoadError, resolve_model_path
from kernels.model._loading import _identity_of

__all__ = ["NotShardable", "check_shardable", "load_sharded"]

_SPLIT_KEYS: tuple[str, ...] = (
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)
"""Config sizes that ``shard()`` divides by the group size (where the config has them)."""


class NotShardable(ModelLoadError):
    """The model cannot be split over this many ranks (no ``shard()``, or a size that does not divide)."""


def check_shardable(config: Mapping[str, Any], size: int) -> None:
    """Raise :class:`NotShardable` when a size ``shard()`` splits does not divide by ``size``.

    NOTE: mlx-lm's ``shard()`` divides the head counts with ``//`` and splits
    each projection's rows evenly: 9 heads over 2 ranks would load and then
    fail (or, worse, compute garbage) in the first forward. Checked from the
    config before any weight is read.
    """
    if size < 1:
        raise NotShardable(f"a group of {size} ranks")
    sources: list[Mapping[str, Any]] = [config]
    text = config.get("text_config")
    if isinstance(text, Mapping):
        sources.append(text)
    bad: list[str] = []
    for source in sources:
        for key in _SPLIT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value % size:
                bad.append(f"{key}={value}")
    if bad:
        raise NotShardable(
            f"the model cannot be split over {size} ranks: {', '.join(bad)} "
            f"not divisible by {size} (docs/tensor-parallel.md lists what divides)"
        )


def load_sharded(path_or_hf_id: str | Path, group: Any) -> LoadedModel:
    """This rank's shard of the model at ``path_or_hf_id`` over ``group`` (an ``mx.distributed.Group``).

    The identity is the whole model's (every rank computes it from the same
    files): the prompt cache keys entries on it, the same on every rank.
    Raises :class:`NotShardable` for a model without tensor parallelism in
    mlx-lm or with sizes that do not divide, ``ModelLoadError`` otherwise.
    """
    import json

    from mlx_lm.utils import sharded_load

    path = resolve_model_path(path_or_hf_id)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path / 'config.json'} is not a JSON object")
    check_shardable(raw, int(group.size()))
    try:
        loaded: Any = sharded_load(str(path), tensor_group=group, return_config=True)
        model, tokenizer, config = loaded
    except ValueError as exc:
        if "tensor parallelism" in str(exc) or "any sharding" in str(exc):
            raise NotShardable(f"{path.name}: mlx-lm has no tensor parallelism for it ({exc})") from exc
        raise ModelLoadError(f"cannot load model from {path}: {exc}") from exc
    except (FileNotFoundError, KeyError) as exc:
        raise ModelLoadError(f"cannot load model from {path}: {exc}") from exc
    identity = _identity_of(path_or_hf_id, path, model, tokenizer, config)
    return LoadedModel(
        model=model, tokenizer=tokenizer, config=config, path=path, identity=identity, fusion=None
    )
