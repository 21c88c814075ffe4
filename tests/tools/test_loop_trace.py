"""tools/bench/loop_trace.py: the sitecustomize traces a loop's busy iterations in a real child process; the summary adds callbacks up by name."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.tools._bench_modules import load_bench

loop_trace = load_bench("loop_trace")


def test_a_child_with_the_site_on_its_path_records_its_busy_iteration_by_task_name(tmp_path: Path) -> None:
    """A task that holds the loop for ~30 ms in one step is written with its coroutine's name; idle iterations are not."""
    site = tmp_path / "site"
    loop_trace.write_site(site, None)
    program = textwrap.dedent("""
        import asyncio, time
        async def hog():
            end = time.monotonic() + 0.03
            while time.monotonic() < end:
                pass
        async def main():
            await asyncio.sleep(0.01)
            await asyncio.create_task(hog())
            await asyncio.sleep(0.01)
        asyncio.run(main())
    """)
    subprocess.run([sys.executable, "-c", program], check=True, env={"PYTHONPATH": str(site)},
                   timeout=60)
    (trace,) = site.glob("iters-*.jsonl")
    iterations = loop_trace.read([trace])
    assert len(iterations) == 1
    (it,) = iterations
    assert it["work_ms"] >= 25
    assert it["top"][0][1] == "hog"


def test_the_summary_sums_callbacks_by_name_and_keeps_each_ones_longest(tmp_path: Path) -> None:
    """Two iterations naming ``run_asgi`` 10 + 30 ms: 40 ms in all, 30 the longest, listed first; a torn line is skipped."""
    lines = [
        {"t": 1.0, "iter_ms": 12, "work_ms": 12, "callbacks": 2, "top": [[10, "run_asgi"], [2, "anyio:actor:gateway"]]},
        {"t": 1.5, "iter_ms": 31, "work_ms": 31, "callbacks": 1, "top": [[30, "run_asgi"]]},
    ]
    path = tmp_path / "iters-1.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"t": 2')
    result = loop_trace.summary(loop_trace.read([path]))
    assert result["iterations"] == 2
    assert result["work_ms_sum"] == 43
    assert result["span_ms"] == 500
    assert result["callbacks"][0] == {"name": "run_asgi", "ms": 40, "longest_ms": 30}
    assert result["callbacks"][1]["name"] == "anyio:actor:gateway"


def test_the_totals_count_every_iteration_and_a_ready_select_that_waits_for_the_gil(tmp_path: Path) -> None:
    """Beside a thread spinning in Python, 0.3 s of ``sleep(0)`` hops are all counted and a ready select waits ~5 ms for the GIL."""
    site = tmp_path / "site"
    loop_trace.write_site(site, None)
    program = textwrap.dedent("""
        import asyncio, threading, time
        stop = False
        def spin():
            while not stop:
                pass
        async def main():
            global stop
            thread = threading.Thread(target=spin)
            thread.start()
            # NOTE: long enough for the spinning thread to force GIL switches
            # (every 5 ms): some of them land in a ready select.
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                await asyncio.sleep(0)
            stop = True
            thread.join()
            await asyncio.sleep(1.1)  # NOTE: past the once-a-second totals line.
            await asyncio.sleep(0)
        asyncio.run(main())
    """)
    subprocess.run([sys.executable, "-c", program], check=True, env={"PYTHONPATH": str(site)},
                   timeout=60)
    traces = list(site.glob("iters-*.jsonl"))
    totals = loop_trace.read_totals(traces)
    assert totals["iterations"] >= 200
    assert totals["ready_selects"] >= 200
    assert totals["switch_interval_s"] == 0.005
    assert totals["ready_select_max_s"] >= 0.004
    assert totals["ready_selects_over_1ms"] >= 1
    assert all("totals" not in row for row in loop_trace.read(traces))
