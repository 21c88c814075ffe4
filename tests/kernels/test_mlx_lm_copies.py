"""What kvtier copied from mlx-lm, or relies on in its internals, is what the installed mlx-lm has: a new mlx-lm fails here until it is compared.

``decode_step`` (kernels/engine/_greedy.py) is mlx-lm 0.32.2's
``GenerationBatch._step`` with kvtier's two choices; ``retract`` puts back
exactly the attributes mlx-lm 0.32.2's ``BatchKVCache.update_and_fetch``
changes (keys and values written in place, offset rebound, write index).
When mlx-lm changes either, the copy or the take-back may silently fall
behind; this test names the place to compare, and its hash moves only once
that is done.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import pytest
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache

COMPARED: tuple[tuple[Any, str, str], ...] = (
    (GenerationBatch._step, "d7513c5031029194", "kernels/engine/_greedy.py decode_step (its copy of this step)"),
    (
        BatchKVCache.update_and_fetch,
        "d099a9c8781d7d67",
        "kernels/engine/_greedy.py GreedyGenerationBatch._retract_state / retract (what a build changes)",
    ),
)
"""mlx-lm's function, the hash of its source when kvtier was last compared with it (mlx-lm 0.32.2), and kvtier's place that depends on it."""


def _digest(fn: Any) -> str:
    """The first 16 hex digits of the SHA-256 of ``fn``'s source."""
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


@pytest.mark.parametrize(("fn", "digest", "ours"), COMPARED, ids=[fn.__qualname__ for fn, _, _ in COMPARED])
def test_the_installed_mlx_lm_is_the_one_kvtier_was_compared_with(fn: Any, digest: str, ours: str) -> None:
    """Each mlx-lm function kvtier copied or relies on has the source kvtier was compared with."""
    assert _digest(fn) == digest, (
        f"mlx-lm's {fn.__qualname__} changed: compare it with {ours}, then record its new hash here"
    )
