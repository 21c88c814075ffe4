"""The Engine says in stats() whether one-token CPU steps use the few-row product, and why not."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.engine import Engine
from kernels.native import few_row_status

pytestmark = [pytest.mark.anyio, pytest.mark.model]


async def test_stats_name_the_few_row_status_and_routed_products(default_model_path: Path) -> None:
    """On the default model (CPU): ``few_row`` holds the load's status; on means products were routed."""
    async with Engine(default_model_path, max_queue=1, prompt_cache_bytes=1 << 26) as engine:
        stats = await engine.stats()
    few_row = stats["few_row"]
    assert few_row["status"] == few_row_status()
    if few_row["status"].startswith("on"):
        assert few_row["products"] > 0
    else:
        assert few_row["products"] == 0
