"""Generation's stream follows the device kvtier computes on, not the one mlx-lm saw at import."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import pytest

from kernels import _device

lm_generate: Any = importlib.import_module("mlx_lm.generate")
"""The module (``mlx_lm.generate`` as an attribute is the function mlx-lm re-exports)."""


@dataclass(frozen=True)
class _GpuStream:
    """A stand-in for mlx-lm's stream as a GPU host imports it (before ``--device cpu``)."""

    device: Any = "gpu"


def test_mlx_lms_stream_is_used_where_its_device_is_the_default() -> None:
    """On the device mlx-lm's stream was made for, generation shares that stream."""
    assert lm_generate.generation_stream.device == mx.default_device()
    assert _device.generation_stream() is lm_generate.generation_stream


def test_a_stream_made_for_another_device_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where mlx-lm's stream is on another device (imported on a GPU host, then --device cpu),
    generation runs on a stream of the default device instead, the same one on every call,
    and work on it computes there."""
    monkeypatch.setattr(lm_generate, "generation_stream", _GpuStream())
    monkeypatch.setattr(_device, "_streams", {})
    stream = _device.generation_stream()
    assert stream.device == mx.default_device()
    assert _device.generation_stream() is stream
    with mx.stream(stream):
        out = mx.arange(4) * 2
    mx.eval(out)
    assert out.tolist() == [0, 2, 4, 6]
