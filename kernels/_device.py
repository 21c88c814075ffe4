"""Which device MLX computes on: ``--device`` (``KVTIER_DEVICE``), applied before the model loads."""

from __future__ import annotations

from typing import Literal

__all__ = ["DeviceChoice", "select_device"]

DeviceChoice = Literal["auto", "cpu"]
"""``auto``: MLX's own default (its GPU where it has one: CUDA or Metal); ``cpu``: the CPU."""


def select_device(choice: DeviceChoice) -> Literal["cpu", "gpu"]:
    """Make ``choice`` MLX's default device; the kind of device MLX now computes on.

    NOTE: MLX's default device is one setting of the whole process, not of a
    thread: every thread that computes (the engine thread, the SSD tier's
    host reads) follows it, and so does the rest of an application that
    embeds the engine. ``auto`` changes nothing.
    """
    import mlx.core as mx

    if choice == "cpu":
        mx.set_default_device(mx.cpu)
    return "cpu" if mx.default_device() == mx.cpu else "gpu"
