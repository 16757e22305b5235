"""The device side of the world: exact mode's deterministic CUDA kernels, decided by the device type.

Nothing here touches a GPU: ``deterministic_kernels`` only sets torch's global flag and the
environment, which a CPU machine has too. The global flag is restored after every test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from nanotron_recover.parallel.world import (
    CUBLAS_DETERMINISTIC,
    CUBLAS_WORKSPACE_ENV,
    deterministic_kernels,
)


@pytest.fixture(autouse=True)
def torch_determinism(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Start each test with deterministic algorithms off and no cuBLAS setting; restore both after."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    monkeypatch.delenv(CUBLAS_WORKSPACE_ENV, raising=False)  # monkeypatch restores the caller's value
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def test_cpu_changes_nothing():
    assert deterministic_kernels("cpu") is None
    assert torch.are_deterministic_algorithms_enabled() is False
    assert CUBLAS_WORKSPACE_ENV not in os.environ


def test_cuda_turns_deterministic_algorithms_on_and_sets_the_cublas_workspace(monkeypatch):
    line = deterministic_kernels("cuda")
    assert torch.are_deterministic_algorithms_enabled() is True
    assert torch.is_deterministic_algorithms_warn_only_enabled() is False  # raise, never vary silently
    assert os.environ[CUBLAS_WORKSPACE_ENV] == CUBLAS_DETERMINISTIC == ":4096:8"
    assert line == (
        "recover.exact on CUDA: deterministic kernels (torch.use_deterministic_algorithms(True), "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8)"
    )


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (":16:8", "also deterministic, with a smaller workspace"),
        (":0:0", "cuBLAS is deterministic only with :4096:8 or :16:8, so a matrix product may raise"),
    ],
)
def test_a_users_cublas_setting_is_kept_with_a_warning(monkeypatch, given, says):
    monkeypatch.setenv(CUBLAS_WORKSPACE_ENV, given)
    line = deterministic_kernels("cuda")
    assert os.environ[CUBLAS_WORKSPACE_ENV] == given
    assert torch.are_deterministic_algorithms_enabled() is True
    assert line is not None and "\n" not in line
    assert line.startswith("warning: recover.exact on CUDA: deterministic kernels")
    assert f"CUBLAS_WORKSPACE_CONFIG='{given}' is kept as set, not :4096:8: {says}" in line


def test_the_same_setting_already_made_is_no_warning(monkeypatch):
    monkeypatch.setenv(CUBLAS_WORKSPACE_ENV, CUBLAS_DETERMINISTIC)
    line = deterministic_kernels("cuda")
    assert line is not None and not line.startswith("warning") and "as already set" in line
    assert torch.are_deterministic_algorithms_enabled() is True
