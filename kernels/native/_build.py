"""Build the few-row product's MLX extension on demand, cache it, load it.

The extension (``src/few_row.c``: the few-row kernel; ``src/softmax.c``:
CPU attention's softmax; ``src/pool.c``: their worker threads;
``src/few_row.cpp``: MLX primitives around them,
bound with nanobind in MLX's type domain) must be compiled against the MLX
that is installed, so it is built on this machine:
the first time it is asked for, into ``$KVTIER_HOME/native/<key>``, where
the key digests the sources, MLX's and nanobind's versions and the Python
ABI. Later processes load the cached module. A file lock serializes builds,
so servers and tests starting together build once. The module is written to
a temporary file, fsynced, renamed into place and its directory fsynced, so
a crash leaves either no module or a whole one.

NOTE: loading a shared object runs its code, so ``$KVTIER_HOME``,
``native/``, the key directory and the module must belong to this user and
be writable by nobody else (``kernels._trust``); otherwise kvtier
keeps MLX's product and says why. A failed build (or a module that fails to
import or its check) is recorded in ``<key>/build-failed.json`` with the
toolchain it failed with (compilers, libmlx, nanobind, Python): later
processes do not rebuild while that toolchain is unchanged, and build again
as soon as any part of it changes (or the record is deleted).

Needs a C and a C++ compiler (``cc``/``c++``, or ``$CC``/``$CXX``), Python's
headers, the ``nanobind`` package, an x86-64 CPU with AVX2 and FMA, and
Linux. Where anything is missing, :func:`load_extension` says why in
:class:`NativeUnavailable` and kvtier keeps MLX's own product.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from kernels._env import env_text
from kernels._paths import kvtier_home
from kernels._trust import UntrustedPath, check_trusted, make_private_dirs, trust_problem

__all__ = [
    "FAILURE_RECORD",
    "MODULE_NAME",
    "NativeUnavailable",
    "cpu_supports_kernel",
    "discard_build",
    "extension_dir",
    "load_extension",
    "toolchain_identity",
]

MODULE_NAME = "_kvtier_few_row"
_SRC = Path(__file__).resolve().parent / "src"
_SOURCES = ("kvtier_simd.h", "kvtier_pool.h", "pool.c", "few_row.c", "softmax.c", "few_row.cpp")

_C_OBJECTS = (("pool.c", "pool.o"), ("few_row.c", "kernel.o"), ("softmax.c", "softmax.o"))
"""The C kernels (AVX2 + FMA) and their object files, linked into the module with few_row.cpp."""

_BUILD_TIMEOUT_S = 600.0
FAILURE_RECORD = "build-failed.json"
"""The record of a failed build in the key directory (JSON: toolchain and reason)."""
_RECORD_MAX_BYTES = 64 * 1024


class NativeUnavailable(RuntimeError):
    """The few-row extension cannot be built or loaded here (the message says why)."""


def cpu_supports_kernel() -> bool:
    """Whether this is Linux on x86-64 with AVX2 and FMA (what the kernel is compiled for)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set(flags.split())
    return "avx2" in words and "fma" in words


def _versions() -> tuple[str, str]:
    import mlx.core as mx

    return str(getattr(mx, "__version__", "?")), str(getattr(_nanobind(), "__version__", "?"))


def _nanobind() -> ModuleType:
    try:
        return importlib.import_module("nanobind")
    except ImportError as exc:
        raise NativeUnavailable("the nanobind package is not installed") from exc


def extension_dir(root: Path | None = None) -> Path:
    """Where the extension for this MLX, nanobind, Python and these sources lives."""
    mlx_version, nb_version = _versions()
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update((_SRC / name).read_bytes())
    for part in (
        mlx_version,
        nb_version,
        sys.version,
        sysconfig.get_config_var("EXT_SUFFIX") or "",
    ):
        digest.update(part.encode())
    return _native_root(root) / digest.hexdigest()[:16]


def _native_root(root: Path | None) -> Path:
    if root is not None:
        return root
    return kvtier_home() / "native"


def _trusted_dirs(directory: Path, root: Path | None) -> list[Path]:
    """The directories whose writers could swap the module: the home (default root), root, key dir."""
    dirs = [] if root is not None else [kvtier_home()]
    return [*dirs, directory.parent, directory]


def _check_trusted(dirs: list[Path], files: tuple[Path, ...] = ()) -> None:
    try:
        check_trusted(dirs, files)
    except UntrustedPath as exc:
        raise NativeUnavailable(f"not loading native code: {exc}") from exc


def _file_identity(path: str) -> str:
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return f"{real}:missing"
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


def toolchain_identity() -> dict[str, str]:
    """What a build's outcome depends on besides the sources: compilers, libmlx, nanobind, Python.

    Raises :class:`NativeUnavailable` when a compiler or nanobind is missing.
    """
    import mlx.core as mx

    mlx_version, nb_version = _versions()
    lib = Path(mx.__file__).resolve().parent / "lib"
    libs = sorted(str(p) for p in lib.glob("libmlx*")) if lib.is_dir() else []
    return {
        "cc": _file_identity(_compiler("CC", "cc", "gcc", "clang")),
        "cxx": _file_identity(_compiler("CXX", "c++", "g++", "clang++")),
        "mlx": mlx_version + " " + " ".join(_file_identity(p) for p in libs),
        "nanobind": nb_version,
        "python": sys.version,
    }


def _module_path(directory: Path) -> Path:
    return directory / (MODULE_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def _run(cmd: list[str], cwd: Path) -> None:
    try:
        done = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise NativeUnavailable(
            f"building the few-row extension timed out after {exc.timeout:.0f} s: {cmd[0]}"
        ) from exc
    except OSError as exc:
        raise NativeUnavailable(f"building the few-row extension failed: {cmd[0]}: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
        raise NativeUnavailable(
            f"building the few-row extension failed: {' '.join(cmd[:2])} ...: " + " | ".join(tail)
        )


def _compiler(env: str, *names: str) -> str:
    chosen = env_text(env)
    if chosen:
        return chosen
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise NativeUnavailable(f"no {' or '.join(names)} compiler on PATH (set ${env})")


def _build(directory: Path) -> None:
    """Compile and link the module into ``directory`` (atomically: a temporary file, then a rename)."""
    import mlx.core as mx

    nanobind = _nanobind()
    cc = _compiler("CC", "cc", "gcc", "clang")
    cxx = _compiler("CXX", "c++", "g++", "clang++")
    mlx_root = Path(mx.__file__).resolve().parent
    mlx_include, mlx_lib = mlx_root / "include", mlx_root / "lib"
    nb_root = Path(str(nanobind.__file__)).resolve().parent
    py_include = sysconfig.get_paths()["include"]
    if not (Path(py_include) / "Python.h").exists():
        raise NativeUnavailable(f"Python's headers are missing ({py_include}/Python.h)")
    if not (mlx_include / "mlx" / "mlx.h").exists():
        raise NativeUnavailable(f"MLX's headers are missing ({mlx_include})")
    with tempfile.TemporaryDirectory(dir=directory) as tmp_name:
        tmp = Path(tmp_name)
        common = ["-O3", "-DNDEBUG", "-fPIC", "-fvisibility=hidden"]
        cxx_flags = [
            *common,
            "-std=gnu++20",
            "-fno-strict-aliasing",
            f"-I{py_include}",
            f"-I{nb_root / 'include'}",
        ]
        for source, obj in _C_OBJECTS:
            _run([cc, *common, "-std=gnu11", "-mavx2", "-mfma", "-c", str(_SRC / source), "-o", obj], tmp)
        _run(
            [
                cxx,
                *cxx_flags,
                "-DNB_BUILD",
                "-DNB_COMPACT_ASSERTIONS",
                f"-isystem{nb_root / 'ext' / 'robin_map' / 'include'}",
                "-c",
                str(nb_root / "src" / "nb_combined.cpp"),
                "-o",
                "nanobind.o",
            ],
            tmp,
        )
        _run(
            [
                cxx,
                *cxx_flags,
                "-DNB_DOMAIN=mlx",
                f"-isystem{mlx_include}",
                "-c",
                str(_SRC / "few_row.cpp"),
                "-o",
                "module.o",
            ],
            tmp,
        )
        out = tmp / _module_path(directory).name
        _run(
            [
                cxx,
                "-shared",
                "-o",
                str(out),
                "module.o",
                "nanobind.o",
                *(obj for _, obj in _C_OBJECTS),
                f"-L{mlx_lib}",
                f"-Wl,-rpath,{mlx_lib}",
                "-lmlx",
                "-lpthread",
            ],
            tmp,
        )
        # NOTE: the linker's mode follows the umask (0775 under 002): make it
        # writable by this user only, as the check before loading requires.
        os.chmod(out, 0o755)
        _fsync_path(out)
        os.replace(out, _module_path(directory))
    _fsync_path(directory)


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (NOTE: a rename is durable once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    if spec is None:
        raise NativeUnavailable(f"cannot load {path}")
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError) as exc:
        raise NativeUnavailable(f"cannot import the few-row extension: {exc}") from exc
    return module


def _read_failure(directory: Path) -> dict[str, object] | None:
    """The failure record in ``directory`` (``None``: none, or not a well-formed trusted one)."""
    record = directory / FAILURE_RECORD
    try:
        if trust_problem(record, file=True) is not None:
            return None
        with open(record, "rb") as f:
            raw = f.read(_RECORD_MAX_BYTES + 1)
    except OSError:
        return None
    try:
        obj = json.loads(raw) if len(raw) <= _RECORD_MAX_BYTES else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("reason"), str):
        return None
    toolchain = obj.get("toolchain")
    if not isinstance(toolchain, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in toolchain.items()
    ):
        return None
    return obj


def _record_failure(directory: Path, toolchain: dict[str, str], reason: str) -> None:
    """Write the failure record atomically (best effort: without it the next process rebuilds)."""
    body = json.dumps({"toolchain": toolchain, "reason": reason[:4000]}).encode()
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".failed-", suffix=".tmp")
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, directory / FAILURE_RECORD)
        _fsync_path(directory)
    except OSError:
        return


def discard_build(reason: str, root: Path | None = None) -> None:
    """Remove the cached module and record ``reason`` against the current toolchain.

    Called when a module that imported fails its check: the next process
    does not load it again, and builds again once the toolchain changes.
    Raises :class:`NativeUnavailable` (no compiler) and ``OSError``.
    """
    directory = extension_dir(root)
    _check_trusted(_trusted_dirs(directory, root))
    _discard(directory, toolchain_identity(), reason)


def _discard(directory: Path, toolchain: dict[str, str], reason: str) -> None:
    try:
        os.unlink(_module_path(directory))
    except FileNotFoundError:
        pass
    _record_failure(directory, toolchain, reason)


def load_extension(root: Path | None = None) -> ModuleType:
    """The compiled module (built first if this machine has no cached build); raises :class:`NativeUnavailable`.

    Also ``OSError`` when the cache directory cannot be created or locked.
    """
    if not cpu_supports_kernel():
        raise NativeUnavailable("the few-row kernel needs Linux on x86-64 with AVX2 and FMA")
    import mlx.core  # noqa: F401  NOTE: registers mx.array with nanobind before the module loads

    directory = extension_dir(root)
    dirs = _trusted_dirs(directory, root)
    make_private_dirs(directory)
    _check_trusted(dirs)
    path = _module_path(directory)
    if not path.exists():
        lock_fd = os.open(
            directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            # NOTE: another process may be building the same key: wait for it.
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            if not path.exists():
                _build_once(directory)
        finally:
            os.close(lock_fd)
    # NOTE: checked again right before the import: the module is code this process runs.
    _check_trusted(dirs, (path,))
    try:
        return _import(path)
    except NativeUnavailable as exc:
        _discard(directory, toolchain_identity(), str(exc))
        raise


def _build_once(directory: Path) -> None:
    """Build, unless the same toolchain already failed here (then say why); record a failure."""
    toolchain = toolchain_identity()
    failed = _read_failure(directory)
    if failed is not None and failed["toolchain"] == toolchain:
        raise NativeUnavailable(
            f"an earlier build with this toolchain failed ({failed['reason']}); it is retried "
            f"when the compiler, MLX, nanobind or Python changes, or after removing "
            f"{directory / FAILURE_RECORD}"
        )
    try:
        _build(directory)
    except NativeUnavailable as exc:
        _record_failure(directory, toolchain, str(exc))
        raise
    try:
        os.unlink(directory / FAILURE_RECORD)
    except FileNotFoundError:
        pass
