"""A missing local model path is reported as a missing directory, never as a bad Hub id."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels import ModelLoadError
from kernels.model._loading import _is_local_path, resolve_model_path


@pytest.mark.parametrize("name", ["/nonexistent/kvtier-model", "./no-such-model", "~/no/such/model",
                                  "models/a/b", "no-such-dir/"])
def test_missing_local_directory_says_not_found(name: str) -> None:
    """A path that does not exist is 'model directory not found', before any Hub lookup."""
    with pytest.raises(ModelLoadError, match="model directory not found"):
        resolve_model_path(name)


def test_relative_path_under_an_existing_directory_is_local(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """'models/smol' is a path (with a typo) when ./models exists; 'owner/name' alone is a Hub id."""
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    assert _is_local_path("models/smol")
    assert not _is_local_path("mlx-community/Qwen3-4B-4bit")
    assert not _is_local_path("gpt2")
    with pytest.raises(ModelLoadError, match="model directory not found"):
        resolve_model_path("models/smol")
