"""Shared fixtures: one small array namespace per backend, so a test runs on both."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import settings

# CI runs the property tests on a fixed sequence of examples, so a red run can be reproduced.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@dataclass
class Framework:
    """What a backend-agnostic test needs: make arrays, read them back, some math."""

    name: str
    array: Callable[[Any], Any]  # numpy -> framework array (float32 for floats)
    to_numpy: Callable[[Any], np.ndarray]
    sum: Callable[[Any], Any]
    tanh: Callable[[Any], Any]
    matmul: Callable[[Any, Any], Any]


def _jax_framework() -> Framework:
    jnp = pytest.importorskip("jax.numpy", reason="the JAX backend needs jax installed")

    def array(x: Any) -> Any:
        x = np.asarray(x)
        return jnp.asarray(x.astype(np.float32) if x.dtype.kind == "f" else x)

    return Framework("jax", array, np.asarray, jnp.sum, jnp.tanh, jnp.matmul)


def _torch_framework() -> Framework:
    torch = pytest.importorskip("torch", reason="the PyTorch backend needs torch installed")

    def array(x: Any) -> Any:
        x = np.asarray(x)
        return torch.from_numpy(x.astype(np.float32) if x.dtype.kind == "f" else x.copy())

    def to_numpy(x: Any) -> np.ndarray:
        return x.detach().cpu().numpy()

    return Framework("torch", array, to_numpy, torch.sum, torch.tanh, torch.matmul)


@pytest.fixture(params=["jax", "torch"])
def fw(request: pytest.FixtureRequest) -> Framework:
    return _jax_framework() if request.param == "jax" else _torch_framework()
