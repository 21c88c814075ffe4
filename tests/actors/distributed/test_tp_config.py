"""What --tensor-parallel accepts at startup: the serial lane, no SSD tier, a model whose heads divide."""

from __future__ import annotations

import argparse

import pytest

from actors.cli.serve import add_arguments, serve_config
from actors.engine.config import ConfigError, EngineConfig
from kernels.distributed import NotShardable, check_shardable


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_turns_the_ssd_tier_and_batch_lane_off_by_default_under_tensor_parallel() -> None:
    """kvtier serve's own defaults (SSD tier on, 8 batch rows) stay off with --tensor-parallel on."""
    config = serve_config(_args("--tensor-parallel", "on"))
    assert config.tensor_parallel
    assert config.ssd_cache is None
    assert config.max_batch == 1
    plain = serve_config(_args())
    assert plain.ssd_cache is not None
    assert plain.max_batch > 1


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("--max-batch", "4"), "--max-batch 1"),
        (("--ssd-cache", "/tmp/kv"), "--ssd-cache off"),
    ],
)
def test_unsupported_combinations_are_startup_errors(argv: tuple[str, ...], needle: str) -> None:
    """An explicit batch lane or SSD tier with --tensor-parallel is a ConfigError saying what to pass."""
    with pytest.raises(ConfigError, match=needle):
        serve_config(_args("--tensor-parallel", "on", *argv))
    with pytest.raises(ConfigError, match=needle):
        EngineConfig(tensor_parallel=True, **{"max_batch": 4} if "batch" in needle
                     else {"ssd_cache": "/tmp/kv"})


def test_heads_that_do_not_divide_are_refused_before_loading() -> None:
    """SmolLM2-135M's 9 query / 3 KV heads do not split over 2 ranks; over 3 they do."""
    smol = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    with pytest.raises(NotShardable, match="num_attention_heads=9"):
        check_shardable(smol, 2)
    check_shardable(smol, 3)
    check_shardable({**smol, "num_attention_heads": 12, "num_key_value_heads": 4}, 2)
    with pytest.raises(NotShardable, match="num_key_value_heads=3"):
        check_shardable({"text_config": {**smol, "num_attention_heads": 12}}, 2)
