"""tools/bench/burst_variants.py reads gpu_serving.sh agent's burst lines into per-variant medians."""

from __future__ import annotations

from tests.tools._bench_modules import load_bench

_TEXT = """\
align=1 clear=1 burst 8 x 40 tokens over a cached 5100, 0 rows decoding, folded attention on, round 1, synchronized: TTFT p50 150.0 max 150.0 ms; steps ms [117.3, 25.7]
align=1 clear=1   phases ms: prefill 84.8, decode 45.1
align=0 clear=1 burst 8 x 40 tokens over a cached 5100, 0 rows decoding, folded attention on, round 1, synchronized: TTFT p50 300.0 max 300.0 ms; steps ms [348.0, 26.2]
align=1 clear=1 burst 8 x 40 tokens over a cached 5100, 8 rows decoding, folded attention on, round 1, synchronized: TTFT p50 250.0 max 250.0 ms; steps ms [223.0, 32.0]
align=1 clear=1 burst 8 x 40 tokens over a cached 5100, 0 rows decoding, folded attention on, round 1, synchronized: TTFT p50 170.0 max 170.0 ms; steps ms [117.3, 25.7]
align=1 clear=1 burst 8 x 40 tokens over a cached 5100, 0 rows decoding, folded attention on, round 1, synchronized: TTFT p50 160.0 max 160.0 ms; steps ms [117.3, 25.7]
"""


def test_rounds_are_grouped_by_variant_and_load_and_compared_to_the_first_variant() -> None:
    """Each summary line lands under its (variant, rows decoding); phase lines are skipped; ratios use the first variant's median."""
    bench = load_bench("burst_variants")
    runs = bench.parse(_TEXT)
    assert runs == {
        ("align=1 clear=1", 0): [150.0, 170.0, 160.0],
        ("align=0 clear=1", 0): [300.0],
        ("align=1 clear=1", 8): [250.0],
    }
    lines = bench.table(runs)
    padded = next(line for line in lines if "align=0" in line)
    assert "median 300.0" in padded
    assert "x 1.88 of align=1 clear=1" in padded
    first = next(line for line in lines if line.lstrip().startswith("0 rows") and "align=1" in line)
    assert "median 160.0 [150.0..170.0]" in first
