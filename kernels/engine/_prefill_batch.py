"""mlx-lm's ``PromptProcessingBatch`` with the buffer-cache release after each forward made optional.

mlx-lm's ``prompt`` empties MLX's buffer cache (``mx.clear_cache``) after
every prefill forward and again after rolling a padded group. In a server
whose cache holds gigabytes of freed buffers (prompt-cache entries that
left, earlier batches), each release hands them all back to the device
allocator and the next step allocates afresh. kvtier keeps them by default:
the buffer cache is bounded anyway (``kernels._memory``: 16 MiB on the CPU,
the weights' size under CUDA), the batch lane releases it on its own
schedule (``_CLEAR_EVERY`` steps) and its memory guard settles it before a
reading that could refuse.

NOTE: measured on the H200 (8B shape, ``gpu_serving.sh agent`` at
``be8d971``, docs/benchmarks/serving.md): eight 40-token suffixes over a
cached 5,100-token prefix joined in 128 / 138 / 128 ms kept against 148 /
160 / 155 ms emptied (three rounds, interleaved), 208-242 vs 252-271 ms
beside eight decoding rows; served agent turns 2-4 TTFT p50 373 vs 459 ms.
``KVTIER_BATCH_PREFILL_CLEAR=1`` restores mlx-lm's releases.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch

from kernels._env import env_switch

__all__ = ["PREFILL_CLEAR_ENV", "PrefillBatch"]

PREFILL_CLEAR_ENV = "KVTIER_BATCH_PREFILL_CLEAR"
"""Environment switch: ``1`` empties MLX's buffer cache after each batch-lane prefill forward (default off)."""


class PrefillBatch(PromptProcessingBatch):
    """``PromptProcessingBatch`` whose ``prompt`` releases MLX's buffer cache only if ``clear``."""

    def __init__(self, *args: Any, clear: bool | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clear = env_switch(PREFILL_CLEAR_ENV, default=False) if clear is None else clear

    def prompt(self, tokens: list[list[int]]) -> None:
        """Forward ``tokens`` (one list per row) into the rows' caches, as mlx-lm's ``prompt``."""
        # NOTE: mlx-lm's ``split`` copies a batch through ``__new__`` (no
        # ``__init__``): such a copy follows the environment's switch.
        clear = getattr(self, "clear", None)
        if clear is None:
            clear = env_switch(PREFILL_CLEAR_ENV, default=False)
        if clear:
            super().prompt(tokens)
            return
        if len(self.uids) != len(tokens):
            raise ValueError("The batch length doesn't match the number of inputs")
        if not tokens:
            return
        for held, new in zip(self.tokens, tokens, strict=True):
            held += new
        lengths = [len(t) for t in tokens]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        if max(padding) > 0:
            inputs = mx.array([t + [0] * (longest - len(t)) for t in tokens])
            for c in self.prompt_cache:
                c.prepare(lengths=lengths, right_padding=padding)
        else:
            inputs = mx.array(tokens)
        while inputs.shape[1] > 0:
            n = min(self.prefill_step_size, inputs.shape[1])
            self.model(inputs[:, :n], cache=self.prompt_cache)
            mx.eval([c.state for c in self.prompt_cache])
            inputs = inputs[:, n:]
        if max(padding) > 0:
            for c in self.prompt_cache:
                c.finalize()
            mx.eval([c.state for c in self.prompt_cache])
