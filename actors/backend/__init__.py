"""The MLX backend the turn runner drives: one ``kernels.Generation`` step per turn."""

from __future__ import annotations

from .mlx import MlxBackend, runtime_identity

__all__ = ["MlxBackend", "runtime_identity"]
