"""Build the few-row product's MLX extension on demand, cache it, load it.

The extension (``src/few_row.c``: the kernel; ``src/few_row.cpp``: an MLX
primitive around it, bound with nanobind in MLX's type domain) must be
compiled against the MLX that is installed, so it is built on this machine:
the first time it is asked for, into ``$KVTIER_HOME/native/<key>``, where
the key digests the sources, MLX's and nanobind's versions and the Python
ABI. Later processes load the cached module. A file lock serializes builds,
so servers and tests starting together build once.

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
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

__all__ = [
    "MODULE_NAME",
    "NativeUnavailable",
    "cpu_supports_kernel",
    "extension_dir",
    "load_extension",
]

MODULE_NAME = "_kvtier_few_row"
_SRC = Path(__file__).resolve().parent / "src"
_SOURCES = ("few_row.c", "few_row.cpp")
_BUILD_TIMEOUT_S = 600.0


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
    if root is None:
        from kernels.model import kvtier_home

        root = kvtier_home() / "native"
    return root / digest.hexdigest()[:16]


def _module_path(directory: Path) -> Path:
    return directory / (MODULE_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def _run(cmd: list[str], cwd: Path) -> None:
    done = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
        raise NativeUnavailable(
            f"building the few-row extension failed: {' '.join(cmd[:2])} ...: " + " | ".join(tail)
        )


def _compiler(env: str, *names: str) -> str:
    chosen = os.environ.get(env)
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
    directory.mkdir(parents=True, exist_ok=True)
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
        _run(
            [
                cc,
                *common,
                "-std=gnu11",
                "-mavx2",
                "-mfma",
                "-c",
                str(_SRC / "few_row.c"),
                "-o",
                "kernel.o",
            ],
            tmp,
        )
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
                "kernel.o",
                f"-L{mlx_lib}",
                f"-Wl,-rpath,{mlx_lib}",
                "-lmlx",
                "-lpthread",
            ],
            tmp,
        )
        os.replace(out, _module_path(directory))


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    if spec is None:
        raise NativeUnavailable(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load_extension(root: Path | None = None) -> ModuleType:
    """The compiled module (built first if this machine has no cached build); raises :class:`NativeUnavailable`."""
    if not cpu_supports_kernel():
        raise NativeUnavailable("the few-row kernel needs Linux on x86-64 with AVX2 and FMA")
    import mlx.core  # noqa: F401  NOTE: registers mx.array with nanobind before the module loads

    directory = extension_dir(root)
    path = _module_path(directory)
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / ".lock", "w") as lock:
            # NOTE: another process may be building the same key: wait for it.
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not path.exists():
                    _build(directory)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    try:
        return _import(path)
    except ImportError as exc:
        raise NativeUnavailable(f"cannot import the few-row extension: {exc}") from exc
