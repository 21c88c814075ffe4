"""tools/bench/join_cost.py binds on the CPU the attention kvtier serves with, not a CUDA-only variant."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kernels.model import _masked_attention as impl
from kernels.model import unbind_masked_attention
from tests.kernels.test_generation import lively_llama, tiny_tokenizer
from tests.tools._bench_modules import load_bench


def test_on_binds_the_native_softmax_path_on_the_cpu() -> None:
    """``--attention on`` on the CPU binds what install() binds there (the native softmax's folded
    products), so the tool's joins cost what the server's do; ``off`` gives mlx-lm's own back."""
    from kernels.native import softmax_op

    if mx.default_device() != mx.cpu or softmax_op() is None:
        pytest.skip("the native softmax is built for the CPU only")
    bench = load_bench("join_cost")
    model = lively_llama(len(tiny_tokenizer()), seed=5)
    try:
        bench.set_attention(model, "on")
        assert impl._cpu_softmax is not None
        bench.set_attention(model, "off")
        module = __import__(type(model).__module__, fromlist=["scaled_dot_product_attention"])
        assert module.scaled_dot_product_attention is impl._ORIGINAL
    finally:
        unbind_masked_attention(model)
