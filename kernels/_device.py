"""Which device MLX computes on: ``--device`` (``KVTIER_DEVICE``), applied before the model loads."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Literal

from kernels._env import env_switch

__all__ = [
    "READ_FIRST_ENV",
    "DeviceChoice",
    "async_eval_blocks",
    "generation_stream",
    "read_first_setting",
    "select_device",
]

READ_FIRST_ENV = "KVTIER_READ_FIRST"
"""Environment switch (on unless an off word; CPU only): a decode step computes its tokens before it queues the next forward."""

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


_streams: dict[str, Any] = {}
_streams_lock = threading.Lock()


def generation_stream() -> Any:
    """The thread-local stream generation runs on, on MLX's default device as it is now.

    NOTE: mlx-lm makes its ``generation_stream`` when it is imported, on the
    default device of that moment: on a CUDA or Metal host, before
    ``--device cpu`` is applied, that is the GPU. Generation under it then ran
    on the GPU, and since MLX 0.31.2 an array made on one thread's GPU stream
    cannot be evaluated on another (``There is no Stream(gpu, 0) in current
    thread``): CPU replicas on a GPU host failed a third of their batch steps.
    mlx-lm's stream is used where its device is the default one (its GPU
    streams stay the ones mlx-lm's own code shares), else one of kvtier's own
    on the default device, made once per device.
    """
    import mlx.core as mx
    from mlx_lm.generate import generation_stream as lm_stream

    device = mx.default_device()
    if lm_stream.device == device:
        return lm_stream
    key = str(device)
    with _streams_lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = mx.new_thread_local_stream(device)
    return stream


def async_eval_blocks() -> bool:
    """Whether ``mx.async_eval`` computes most of a graph before it returns: MLX's CPU backend.

    NOTE: MLX's evaluation waits whenever more than ten tasks are in flight
    (``MAX_ACTIVE_TASKS`` in mlx/transforms.cpp, 0.32). On the CPU every
    operation is a task, so ``async_eval`` of a forward returns once all but
    its last ten operations have run (the default model on 2 cores: 74 of a
    90 ms forward); a GPU stream's tasks are whole command buffers, and it
    returns at once. Read on the thread that computes, after ``--device``.
    """
    import mlx.core as mx

    return bool(mx.default_device() == mx.cpu)


def read_first_setting(env: Mapping[str, str] | None = None) -> bool:
    """Whether decode steps compute their own tokens before they queue the next forward.

    Where ``async_eval`` blocks (:func:`async_eval_blocks`: the CPU),
    mlx-lm's order (queue the next forward, then read this step's tokens)
    hands each token out one whole forward after it was computed; there
    this is on unless ``KVTIER_READ_FIRST`` says off. On a GPU it is off
    (the next forward queued first keeps the device busy while the host
    reads and delivers).
    """
    return async_eval_blocks() and env_switch(READ_FIRST_ENV, env)
