"""Shared fixtures: one small array namespace per backend, so a test runs on both.

The device switch: ``PERGRAD_TEST_DEVICE`` (default ``cpu``; e.g. ``cuda``, ``cuda:1``) is the
torch device the tests make tensors on; ``fw.array`` (torch) and the ``device`` fixture follow
it. JAX tests run on whatever ``jax.devices()`` gives (``JAX_PLATFORMS=cpu`` to pin the CPU).
See tests/README.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import settings

# CI runs the property tests on a fixed sequence of examples, so a red run can be reproduced.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

DEVICE_VARIABLE = "PERGRAD_TEST_DEVICE"
OPTIMIZE_VARIABLE = "PERGRAD_TEST_XLA_OPTIMIZE"


def torch_device_name() -> str:
    """The torch device tests make tensors on: ``$PERGRAD_TEST_DEVICE``, default ``"cpu"``."""
    return os.environ.get(DEVICE_VARIABLE, "cpu").strip() or "cpu"


def pytest_configure(config: pytest.Config) -> None:
    """A device that does not exist stops the run at once, with the reason, instead of failing
    every torch test. Only a device other than the CPU imports torch here."""
    config.addinivalue_line(
        "markers",
        "cpu_only(reason): runs only when PERGRAD_TEST_DEVICE is cpu; skipped elsewhere with the "
        "reason",
    )
    name = torch_device_name()
    if name == "cpu":
        return
    try:
        import torch
    except ImportError:
        return  # the torch tests skip themselves
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise pytest.UsageError(f"{DEVICE_VARIABLE}={name!r} is not a torch device: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"{DEVICE_VARIABLE}={name}: torch {torch.__version__} sees no GPU "
            "(torch.cuda.is_available() is False)"
        )
    full_float32_references(torch)


def full_float32_references(torch: Any) -> None:
    """On a GPU, the tests' references (a loop of gradients, ``vmap(grad)``, the model's own
    backward pass) in float32, not TensorFloat-32: JAX's float32 products default to TF32 on a
    GPU and cuDNN's convolutions do in torch, which rounds them to ``2**-11`` while the tests'
    float32 tolerances are ``~1e-5`` (issue 38: 15 failures on an H100, all of them TF32).
    pergrad's own norms run without TF32 whatever the setting (tests/test_dp_mixed_precision)."""
    if hasattr(torch.backends.cudnn, "conv") and hasattr(
        torch.backends.cudnn.conv, "fp32_precision"
    ):
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    else:
        torch.backends.cudnn.allow_tf32 = False
    try:
        import jax
    except ImportError:
        return
    jax.config.update("jax_default_matmul_precision", "highest")


# The device subset (``-m device``): the modules whose torch and JAX arrays follow the device of
# the run, chosen to cover the capture kernel, the norm routes and the DP step in about four
# minutes on a GPU machine (scripts/gpu_check.sh runs them there; the first run, on an H100 with
# 14 workers, took 290 s for 97% of a subset that also held the metagradient and exact-influence
# modules, whose JAX programs compile slowly there).
DEVICE_SUBSET = {
    "test_device_hygiene.py",
    "test_norms.py",
    "test_ghost.py",
    "test_ghost_lowmem.py",
    "test_certified_norms.py",
    "test_norm_routes.py",
    "test_cancellation.py",
    "test_tied_ghost.py",
    "test_dp.py",
    "test_dp_noise.py",
    "test_dp_mixed_precision.py",
    "test_dp_user_level_ghost.py",
    "test_dp_token_losses.py",
    "test_layouts_torch.py",
    "test_attention_rule.py",
    "test_bare_parameters.py",
    "test_hf_transformers.py",
    "test_compile.py",
    "test_auto_choice.py",
    "test_ghost_jax.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in DEVICE_SUBSET:
            item.add_marker(pytest.mark.device)
    if torch_device_name() == "cpu":
        return
    for item in items:
        if marker := item.get_closest_marker("cpu_only"):
            reason = marker.args[0] if marker.args else marker.kwargs.get("reason", "CPU only")
            why = f"not on {DEVICE_VARIABLE}={torch_device_name()}: {reason}"
            item.add_marker(pytest.mark.skip(reason=why))


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"pergrad: torch tensors on {DEVICE_VARIABLE}={torch_device_name()}; "
        "JAX on its default device (JAX_PLATFORMS to choose)"
    )


@pytest.fixture
def device() -> Any:
    """The torch device of the run (``$PERGRAD_TEST_DEVICE``): ``torch.zeros(3, device=device)``,
    ``model.to(device)``. Skips the test when torch is not installed."""
    torch = pytest.importorskip("torch", reason="the PyTorch backend needs torch installed")
    return torch.device(torch_device_name())


@pytest.fixture(scope="module")
def fast_xla_compile() -> Iterator[None]:
    """XLA's backend optimisations off while a module's tests run (JAX on the CPU).

    A module of small JAX programs of many shapes, most of them run op by op, waits mostly for
    XLA's compiler; ``jax_disable_most_optimizations`` (no LLVM backend optimisation) cuts
    that by a fifth (op by op) to a half (whole programs), and a result changes only by
    rounding, as with ``FAST_COMPILE`` in tests/test_layouts_jax.py. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("fast_xla_compile")``; not a numerics-sensitive one
    (float32 cancellation, clipping at a bound), where rounding decides. In this process only
    (subprocesses do not inherit it); not on a GPU; not with ``PERGRAD_TEST_XLA_OPTIMIZE=1``.
    """
    try:
        import jax
    except ImportError:  # a module's torch tests run without JAX
        yield
        return
    if os.environ.get(OPTIMIZE_VARIABLE, "").strip() or jax.default_backend() != "cpu":
        yield
        return
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@dataclass
class Framework:
    """What a backend-agnostic test needs: make arrays, read them back, some math."""

    name: str
    array: Callable[[Any], Any]  # numpy -> framework array (float32 for floats)
    to_numpy: Callable[[Any], np.ndarray]
    sum: Callable[[Any], Any]
    tanh: Callable[[Any], Any]
    matmul: Callable[[Any, Any], Any]
    device: Any = None  # torch: the device of the run, for tensors a test makes itself


def _jax_framework() -> Framework:
    jnp = pytest.importorskip("jax.numpy", reason="the JAX backend needs jax installed")

    def array(x: Any) -> Any:
        x = np.asarray(x)
        return jnp.asarray(x.astype(np.float32) if x.dtype.kind == "f" else x)

    return Framework("jax", array, np.asarray, jnp.sum, jnp.tanh, jnp.matmul)


def _torch_framework() -> Framework:
    torch = pytest.importorskip("torch", reason="the PyTorch backend needs torch installed")
    device = torch.device(torch_device_name())

    def array(x: Any) -> Any:
        x = np.asarray(x)
        x = x.astype(np.float32) if x.dtype.kind == "f" else x.copy()
        return torch.from_numpy(x).to(device)

    def to_numpy(x: Any) -> np.ndarray:
        return x.detach().cpu().numpy()

    return Framework("torch", array, to_numpy, torch.sum, torch.tanh, torch.matmul, device)


@pytest.fixture(params=["jax", "torch"])
def fw(request: pytest.FixtureRequest) -> Framework:
    return _jax_framework() if request.param == "jax" else _torch_framework()
