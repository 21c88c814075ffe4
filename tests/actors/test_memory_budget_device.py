"""The memory guard's default budget is bounded by the device's memory under CUDA."""

from __future__ import annotations

import pytest

import kernels
from actors.engine.memory import default_budget_bytes

GIB = 1 << 30


@pytest.mark.parametrize(("device", "want"), [(24 * GIB, 24 * GIB), (0, None)])
def test_a_cuda_device_smaller_than_the_host_bounds_the_budget(
    monkeypatch: pytest.MonkeyPatch, device: int, want: int | None
) -> None:
    """A 24 GiB card in a host with 60 GiB available: the budget is the card's 24 GiB; with no
    separate device (CPU, Metal) it is the host's usable memory (60 GiB + what the process holds)."""
    monkeypatch.setattr(kernels, "available_memory_bytes", lambda: 60 * GIB)
    monkeypatch.setattr(kernels, "device_memory_bytes", lambda: device)
    budget = default_budget_bytes()
    if want is not None:
        assert budget == want
    else:
        assert budget >= 60 * GIB
