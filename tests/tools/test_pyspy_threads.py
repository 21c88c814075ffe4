"""tools/bench/pyspy_threads.py: py-spy's raw stacks summed per thread, self and total frames."""

from __future__ import annotations

from tests.tools._bench_modules import load_bench

spy = load_bench("pyspy_threads")

RAW = [
    "thread (11): kvtier-engine;run (engine.py:10);step (batch.py:20);eval (batch.py:30) 6\n",
    "thread (11): kvtier-engine;run (engine.py:10);step (batch.py:20) 2\n",
    "thread (12): kvtier-store;work (store.py:5);hash (store.py:9) 2\n",
    "not a stack line\n",
]


def test_samples_are_summed_per_thread_with_self_and_total_shares() -> None:
    """Each thread gets its own stacks; self counts the leaf, total every frame once per stack."""
    threads = spy.parse(RAW)
    assert {t: sum(c for _, c in s) for t, s in threads.items()} == {
        "thread (11): kvtier-engine": 8, "thread (12): kvtier-store": 2}
    lines = spy.report(threads, top=3, min_share=0.0)
    assert lines[0] == "10 samples in 2 threads"
    engine = lines.index("thread (11): kvtier-engine: 8 samples (80.0%)")
    assert lines[engine + 2] == "     75.0%  eval (batch.py:30)"
    assert lines[engine + 4] == "  total (frames on every stack left out):"
    assert lines[engine + 5] == "     75.0%  eval (batch.py:30)", "run and step are on every stack"
    assert not any("kvtier-store" in line for line in spy.report(threads, top=3, min_share=0.5))
