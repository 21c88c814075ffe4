"""Where kvtier keeps its own files: the one root under which the caches live.

A neutral low module: ``kernels.model`` (the default model, the weights
memo) and ``kernels.native`` (the built few-row module) both need the root,
and neither may import the other for it.
"""

from __future__ import annotations

from pathlib import Path

from kernels._env import env_text

__all__ = ["kvtier_home"]


def kvtier_home() -> Path:
    """Root of kvtier's caches: ``$KVTIER_HOME`` or ``~/.cache/kvtier``."""
    env = env_text("KVTIER_HOME")
    return Path(env).expanduser() if env is not None else Path.home() / ".cache" / "kvtier"
