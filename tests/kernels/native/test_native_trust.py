"""The native module's cache: owner/mode checks, durable rename, failure records, and fallback on any check failure.

Builds here use fake compilers (a script that writes its ``-o`` file) or a
scripted ``_build``; nothing compiles for real, so the tests are fast.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest

from kernels import convert_gguf, load_model
from kernels.native import (
    FAILURE_RECORD,
    NativeUnavailable,
    cpu_supports_kernel,
    extension_dir,
    few_row_op,
    few_row_status,
    load_extension,
)
from kernels.native import _build as build_mod
from kernels.native import _few_row as few_row_mod
from tests.model_fixtures import tiny_llama_gguf

needs_kernel_cpu = pytest.mark.skipif(
    not cpu_supports_kernel(), reason="the few-row kernel needs x86-64 Linux with AVX2 and FMA"
)


def private_root(tmp_path: Path) -> Path:
    """A native cache root that passes the checks (mode 0700, ours)."""
    root = tmp_path / "native"
    root.mkdir(mode=0o700)
    return root


def fake_compiler(tmp_path: Path, name: str) -> str:
    """A 'compiler' that writes a few garbage bytes to its -o argument and exits 0."""
    script = tmp_path / name
    script.write_text(
        "#!/bin/sh\n"
        'out=""\n'
        'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done\n'
        'printf "not an ELF" > "$out"\n'
    )
    script.chmod(0o755)
    return str(script)


class CountingBuild:
    """A scripted ``_build``: fails while ``fail`` is set, counting calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = True

    def __call__(self, directory: Path) -> None:
        self.calls += 1
        if self.fail:
            raise NativeUnavailable("building the few-row extension failed: scripted")
        build_mod._module_path(directory).write_bytes(b"built")


@needs_kernel_cpu
@pytest.mark.parametrize("which", ["root", "key"])
def test_a_group_writable_cache_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    """A native root or key directory others may write is neither built into nor loaded from."""
    scripted = CountingBuild()
    monkeypatch.setattr(build_mod, "_build", scripted)
    root = private_root(tmp_path)
    key = extension_dir(root)
    key.mkdir(mode=0o700)
    (root if which == "root" else key).chmod(0o770)
    with pytest.raises(NativeUnavailable, match="writable by its group or others"):
        load_extension(root)
    assert scripted.calls == 0
    assert not (key / FAILURE_RECORD).exists()


@needs_kernel_cpu
@pytest.mark.parametrize("mode", [0o666, 0o775])
def test_a_module_others_may_write_is_not_loaded(tmp_path: Path, mode: int) -> None:
    """A cached .so that group or others may write is refused before it is imported."""
    root = private_root(tmp_path)
    key = extension_dir(root)
    key.mkdir(mode=0o700)
    module = build_mod._module_path(key)
    module.write_bytes(b"not an ELF")
    module.chmod(mode)
    with pytest.raises(NativeUnavailable, match="writable by its group or others"):
        load_extension(root)


@needs_kernel_cpu
@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_module_of_another_user_is_not_loaded(tmp_path: Path) -> None:
    """A cached .so owned by another uid is refused."""
    root = private_root(tmp_path)
    key = extension_dir(root)
    key.mkdir(mode=0o700)
    module = build_mod._module_path(key)
    module.write_bytes(b"not an ELF")
    module.chmod(0o700)
    os.chown(module, 4242, -1)
    with pytest.raises(NativeUnavailable, match="belongs to uid 4242"):
        load_extension(root)


@needs_kernel_cpu
def test_a_built_module_is_fsynced_renamed_and_its_directory_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module file is fsynced before the rename and the key directory after it."""
    monkeypatch.setenv("CC", fake_compiler(tmp_path, "cc"))
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, "cxx"))
    root = private_root(tmp_path)
    key = extension_dir(root)
    final = build_mod._module_path(key)
    synced: list[tuple[str, bool]] = []
    real = build_mod._fsync_path

    def recording(path: Path) -> None:
        synced.append((str(path), final.exists()))
        real(path)

    monkeypatch.setattr(build_mod, "_fsync_path", recording)
    with pytest.raises(NativeUnavailable, match="cannot import"):
        load_extension(root)
    module_syncs = [(p, there) for p, there in synced if Path(p).name == final.name]
    assert module_syncs, "the module was fsynced"
    assert not module_syncs[0][1], "the module was fsynced before its rename"
    assert (str(key), True) in synced, "the key directory was fsynced after the rename"


@needs_kernel_cpu
def test_a_module_that_fails_to_import_is_discarded_and_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unimportable build is removed and recorded; the next load does not rebuild with that toolchain."""
    monkeypatch.setenv("CC", fake_compiler(tmp_path, "cc"))
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, "cxx"))
    root = private_root(tmp_path)
    key = extension_dir(root)
    with pytest.raises(NativeUnavailable, match="cannot import"):
        load_extension(root)
    assert not build_mod._module_path(key).exists()
    assert (key / FAILURE_RECORD).is_file()
    with pytest.raises(NativeUnavailable, match="earlier build with this toolchain failed"):
        load_extension(root)


@needs_kernel_cpu
def test_a_failed_build_is_retried_only_when_the_toolchain_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same compiler: no second build attempt; another compiler: built again (and the record cleared)."""
    first_cc = fake_compiler(tmp_path, "cc")
    monkeypatch.setenv("CC", first_cc)
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, "cxx"))
    scripted = CountingBuild()
    monkeypatch.setattr(build_mod, "_build", scripted)
    monkeypatch.setattr(build_mod, "_import", lambda path: SimpleNamespace(path=path))
    root = private_root(tmp_path)
    key = extension_dir(root)
    with pytest.raises(NativeUnavailable, match="scripted"):
        load_extension(root)
    with pytest.raises(NativeUnavailable, match="earlier build with this toolchain failed"):
        load_extension(root)
    assert scripted.calls == 1
    monkeypatch.setenv("CC", fake_compiler(tmp_path, "cc2"))
    scripted.fail = False
    load_extension(root)
    assert scripted.calls == 2
    assert not (key / FAILURE_RECORD).exists()


@needs_kernel_cpu
@pytest.mark.parametrize("record", [b"{", b'{"reason": 5}', b"[]"], ids=["broken", "wrong-type", "list"])
def test_a_malformed_failure_record_means_build_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record: bytes
) -> None:
    """A failure record that is not well formed is ignored: the build runs."""
    monkeypatch.setenv("CC", fake_compiler(tmp_path, "cc"))
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, "cxx"))
    scripted = CountingBuild()
    scripted.fail = False
    monkeypatch.setattr(build_mod, "_build", scripted)
    monkeypatch.setattr(build_mod, "_import", lambda path: SimpleNamespace(path=path))
    root = private_root(tmp_path)
    key = extension_dir(root)
    key.mkdir(mode=0o700)
    (key / FAILURE_RECORD).write_bytes(record)
    load_extension(root)
    assert scripted.calls == 1


@needs_kernel_cpu
def test_a_compiler_that_hangs_is_a_fallback_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build step past its timeout raises NativeUnavailable (not subprocess.TimeoutExpired)."""

    def timing_out(cmd: list[str], **kwargs: Any) -> Any:
        raise subprocess.TimeoutExpired(cmd, 600.0)

    monkeypatch.setattr(subprocess, "run", timing_out)
    with pytest.raises(NativeUnavailable, match="timed out"):
        load_extension(private_root(tmp_path))


# --- few_row_op: every failure of the check falls back --------------------------------


def _raising(x: mx.array, w: mx.array, threads: int) -> mx.array:
    raise RuntimeError("[few_row] built against another MLX")


def _wrong(x: mx.array, w: mx.array, threads: int) -> mx.array:
    return mx.zeros((x.shape[0], w.shape[0]))


def _wrong_shape(x: mx.array, w: mx.array, threads: int) -> mx.array:
    return mx.zeros((1, 1))


FAKES: dict[str, tuple[Any, str]] = {
    "raises": (SimpleNamespace(few_row=_raising), "failed its check"),
    "wrong": (SimpleNamespace(few_row=_wrong), "disagrees"),
    "wrong-shape": (SimpleNamespace(few_row=_wrong_shape), "disagrees"),
    "no-symbol": (SimpleNamespace(), "no few_row function"),
}


@pytest.fixture
def discarded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A fresh few_row_op state; discard_build records its reasons instead of touching the cache."""
    reasons: list[str] = []
    monkeypatch.setattr(few_row_mod, "_state", {})
    monkeypatch.setattr(few_row_mod, "discard_build", lambda reason: reasons.append(reason))
    monkeypatch.delenv("KVTIER_FEW_ROW", raising=False)
    return reasons


def use_module(monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
    """Make load_extension return ``module``."""
    loader: Callable[[], Any] = lambda: module  # noqa: E731
    monkeypatch.setattr(few_row_mod, "load_extension", loader)


@pytest.mark.parametrize("case", sorted(FAKES))
def test_every_check_failure_falls_back_and_discards_the_module(
    monkeypatch: pytest.MonkeyPatch, discarded: list[str], case: str
) -> None:
    """An error, a wrong answer or a missing symbol: few_row_op is None, says why, discards the build."""
    module, why = FAKES[case]
    use_module(monkeypatch, module)
    assert few_row_op() is None
    assert few_row_status().startswith("unavailable:")
    assert why in few_row_status()
    assert len(discarded) == 1
    assert why in discarded[0]


def test_a_refused_directory_falls_back_without_discarding(
    monkeypatch: pytest.MonkeyPatch, discarded: list[str]
) -> None:
    """An untrusted cache (NativeUnavailable from the loader) falls back and touches nothing."""

    def refusing() -> Any:
        raise NativeUnavailable("not loading native code: /x is writable by its group or others")

    monkeypatch.setattr(few_row_mod, "load_extension", refusing)
    assert few_row_op() is None
    assert "writable" in few_row_status()
    assert discarded == []


def test_a_model_loads_with_mlx_products_when_the_check_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, discarded: list[str]
) -> None:
    """load_model(few_row=True) with a module whose product raises: the load succeeds, products unrouted."""
    use_module(monkeypatch, FAKES["raises"][0])
    gguf = tmp_path / "tiny.gguf"
    tiny_llama_gguf(gguf, seed=0)
    loaded = load_model(convert_gguf(gguf, tmp_path / "tiny", dequantize=True), few_row=True)
    assert loaded.fusion is not None
    assert loaded.fusion.few_row == 0
    assert "failed its check" in loaded.fusion.few_row_status


def test_the_module_file_mode_is_checked_with_lstat(tmp_path: Path) -> None:
    """A symlink in place of the module is refused (kvtier never creates one)."""
    from kernels import trust_problem

    target = tmp_path / "real.so"
    target.write_bytes(b"x")
    target.chmod(0o700)
    link = tmp_path / "link.so"
    link.symlink_to(target)
    assert trust_problem(target, file=True) is None
    assert trust_problem(link, file=True) == "is not a regular file"
    assert stat.S_ISLNK(os.lstat(link).st_mode)


@needs_kernel_cpu
def test_a_module_built_under_umask_002_passes_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under umask 002 the built module and its directories are still private (refused only for its bytes here)."""
    monkeypatch.setenv("CC", fake_compiler(tmp_path, "cc"))
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, "cxx"))
    root = tmp_path / "home" / "native"
    seen: list[int] = []
    real = build_mod._import

    def importing(path: Path) -> Any:
        seen.append(path.stat().st_mode & 0o777)
        return real(path)

    monkeypatch.setattr(build_mod, "_import", importing)
    old = os.umask(0o002)
    try:
        with pytest.raises(NativeUnavailable, match="cannot import"):
            load_extension(root)
    finally:
        os.umask(old)
    assert seen == [0o755]
    assert (tmp_path / "home").stat().st_mode & 0o777 == 0o700
