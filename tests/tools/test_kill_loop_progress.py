"""The checkpoint kill loop's progress file: a run continues where it stopped, and only the same run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tools.kill_loop_checkpoint import (
    ProgressMismatch,
    Summary,
    _load_progress,
    _save_progress,
    _settings,
)


def _summary() -> Summary:
    return Summary(cycles=3, equal=3, resumed=2, fresh=1, tokens_saved=320,
                   reference_tokens=400, kill_at_chunks=[70, 300, 99],
                   answer_s=[1.5, 2.0, 1.0], commit="abc1234", tree_dirty=False)


def test_a_saved_run_loads_with_its_counts_kill_points_and_reference(tmp_path: Path) -> None:
    """The counts, the reference and the kill-point generator come back as they were saved."""
    settings = _settings(64, 400, 0.0, None, 7, ())
    rng = random.Random(7)
    for _ in range(3):
        rng.randint(65, 399)
    path = tmp_path / "progress.json"
    _save_progress(path, _summary(), rng, settings, ("text", 400))
    loaded = _load_progress(path, settings, Summary(commit="abc1234", tree_dirty=False))
    assert loaded is not None
    summary, again, expected = loaded
    assert summary == _summary()
    assert expected == ("text", 400)
    # NOTE: the continued run draws the kill points the uninterrupted one would have.
    assert [again.randint(65, 399) for _ in range(5)] == [rng.randint(65, 399) for _ in range(5)]
    assert not path.with_name("progress.json.tmp").exists()


def test_no_file_is_a_new_run(tmp_path: Path) -> None:
    """Without a progress file the run starts from cycle 0."""
    settings = _settings(64, 400, 0.0, None, 0, ())
    assert _load_progress(tmp_path / "none.json", settings, Summary()) is None


@pytest.mark.parametrize(
    ("settings", "commit"),
    [
        (_settings(100, 400, 0.0, None, 7, ()), "abc1234"),  # another interval
        (_settings(64, 400, 0.8, 1234, 7, ()), "abc1234"),  # sampled instead of greedy
        (_settings(64, 400, 0.0, None, 7, ()), "def5678"),  # another commit
    ],
)
def test_another_run_refuses_the_file(tmp_path: Path, settings: dict[str, object],
                                      commit: str) -> None:
    """A file of other settings or another commit is refused, not continued."""
    path = tmp_path / "progress.json"
    _save_progress(path, _summary(), random.Random(7), _settings(64, 400, 0.0, None, 7, ()),
                   ("text", 400))
    with pytest.raises(ProgressMismatch):
        _load_progress(path, settings, Summary(commit=commit, tree_dirty=False))
