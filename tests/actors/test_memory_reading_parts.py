"""The guard's reading keeps MLX's active, cache and peak memory apart for ``/stats`` when given ``parts``."""

from __future__ import annotations

from actors.engine.memory import ProcessMemory

MIB = 1 << 20


def test_with_parts_the_mlx_figure_is_active_plus_cache_and_the_parts_are_kept() -> None:
    """(active, cache, peak) = (500, 16, 900) MiB: the reading's MLX figure is 516 MiB, the parts stay readable."""
    figures = [(400 * MIB, 0, 410 * MIB), (500 * MIB, 16 * MIB, 900 * MIB)]
    reading = ProcessMemory(rss=lambda: 800 * MIB, parts=lambda: figures.pop(0))
    assert reading.mlx_at_start == 400 * MIB
    reading.read()
    assert reading.mlx == 516 * MIB
    assert reading.mlx_parts == (500 * MIB, 16 * MIB, 900 * MIB)
