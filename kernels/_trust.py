"""Whether a path under kvtier's own directories may be trusted: ours, and writable by us only.

kvtier loads code (``$KVTIER_HOME/native/*.so``), weights and tokenizers
(``models/``) and KV files (``kv/``) from directories it created. Anyone who
can write there can make this process run their code or serve their KV, so
before using one of them kvtier checks that it belongs to the current user
and that neither its group nor other users may write to it (the rule ssh
applies to ``~/.ssh``). NOTE: the check follows symlinks for directories
(a home directory may be a link) and refuses a symlinked file: kvtier never
creates one.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from kernels._errors import KernelError

__all__ = ["UntrustedPath", "check_trusted", "make_private_dirs", "trust_problem"]


class UntrustedPath(KernelError):
    """A path kvtier would load from is not the current user's, or others may write to it."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(
            f"{self.path} {reason}; kvtier loads code and data from it only when it belongs "
            f"to this user and neither group nor others may write to it "
            f"(fix: chown {os.getuid()} and chmod go-w, or remove it)"
        )


def trust_problem(path: str | Path, *, file: bool = False) -> str | None:
    """Why ``path`` must not be trusted, or ``None`` (it is ours and not group/other-writable).

    ``file``: a regular file is expected (a symlink is refused); otherwise a
    directory (symlinks followed). Raises ``FileNotFoundError`` when absent
    and other ``OSError`` s of ``stat``.
    """
    st = os.lstat(path) if file else os.stat(path)
    if file and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if not file and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    uid = os.getuid()
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}, not to this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def check_trusted(dirs: Iterable[str | Path] = (), files: Iterable[str | Path] = ()) -> None:
    """Raise :class:`UntrustedPath` for the first of ``dirs`` then ``files`` that may not be trusted.

    Every path must exist (``FileNotFoundError`` otherwise).
    """
    for path, is_file in (*((d, False) for d in dirs), *((f, True) for f in files)):
        problem = trust_problem(path, file=is_file)
        if problem is not None:
            raise UntrustedPath(path, problem)


def make_private_dirs(path: str | Path) -> None:
    """``mkdir -p`` whose every new directory is mode 0700 (whatever the umask).

    NOTE: ``os.makedirs(mode=...)`` applies the mode to the last directory
    only; an intermediate one made group-writable by a umask of 002 would
    then fail :func:`check_trusted`.
    """
    missing: list[Path] = []
    cur = Path(path).absolute()
    while not cur.is_dir():
        missing.append(cur)
        if cur.parent == cur:
            break
        cur = cur.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            if not d.is_dir():
                raise
