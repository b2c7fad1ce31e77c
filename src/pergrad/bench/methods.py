"""The methods compared: each builds, for one workload and batch, a call to time.

A method's ``build(workload, model, x, y)`` returns a zero-argument call that computes, for the
whole batch, one of:

* ``kind == "grads"``: per-example gradients, ``{param name: (B, *shape)}``;
* ``kind == "norms"``: per-example gradient norms, ``(B,)``;
* ``kind == "batch"``: the gradient of the mean loss, ``{param name: shape}`` (the floor);
* ``kind == "write"``: fresh float32 arrays of the shapes of the per-example gradients, filled:
  the cost of writing ``B x P`` numbers (``P`` parameters). The floor of a per-example
  gradient method is the batch gradient plus this write; that of a norm method, the batch
  gradient alone.

Every call blocks until its result is computed (``jax.block_until_ready``, CUDA synchronize).
Torch methods run on the device of the model they are given (data moved there); JAX methods on
the JAX device of the same kind (``jax_device``). A method whose package is missing is skipped;
one that raises on a workload is reported as unsupported there.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from pergrad.bench.workloads import Workload, jax_batch_loss, torch_loss, torch_loss_function

Call = Callable[[], Any]


@dataclass(frozen=True)
class Method:
    name: str
    framework: str  # "torch" | "jax": which floor it is compared to
    kind: str  # "grads" | "norms" | "batch" | "write"
    requires: tuple[str, ...]  # importable module names
    build: Callable[[Workload, nn.Module, np.ndarray, np.ndarray], Call]

    def missing(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


def default_device() -> torch.device:
    """cuda if torch sees a GPU, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def jax_device(device: torch.device) -> Any:
    """The JAX device of the same kind as torch's ``device`` (its index on a multi-GPU
    machine), or None when JAX has none of that kind (a CPU-only jaxlib)."""
    import jax

    platform = "gpu" if device.type == "cuda" else device.type
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        return None
    return devices[device.index or 0] if (device.index or 0) < len(devices) else None


def synced(call: Call, device: torch.device) -> Call:
    if device.type != "cuda":
        return call

    def run() -> Any:
        out = call()
        torch.cuda.synchronize(device)
        return out

    return run


def torch_inputs(model: nn.Module, x: np.ndarray, y: np.ndarray):
    """The model and the batch as tensors on the model's device."""
    device = device_of(model)
    return model, torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)


def loss_of_one(workload: Workload, model: nn.Module):
    """The loss of ONE example, for torch.func: the model sees a batch of one."""

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch_loss(workload, functional_call(model, params, (x.unsqueeze(0),)), y[None])

    return loss


def detached_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def result_shapes(model: nn.Module, x: np.ndarray) -> dict[str, tuple[int, ...]]:
    """``{param name: (B, *param shape)}``: the per-example gradients, B x P numbers in all."""
    return {name: (len(x), *p.shape) for name, p in model.named_parameters()}


# --------------------------------------------------------------------------------------------
# PyTorch.


def build_torch_floor(workload, model, x, y) -> Call:
    model, x_t, y_t = torch_inputs(model, x, y)
    names, weights = zip(*model.named_parameters())

    def call() -> dict[str, torch.Tensor]:
        loss = torch_loss(workload, model(x_t), y_t)
        return dict(zip(names, torch.autograd.grad(loss, weights)))

    return synced(call, device_of(model))


def build_torch_loop(workload, model, x, y) -> Call:
    model, x_t, y_t = torch_inputs(model, x, y)
    names, weights = zip(*model.named_parameters())

    def call() -> dict[str, torch.Tensor]:
        rows = []
        for i in range(len(x_t)):
            loss = torch_loss(workload, model(x_t[i : i + 1]), y_t[i : i + 1])
            rows.append(torch.autograd.grad(loss, weights))
        return {name: torch.stack(column) for name, column in zip(names, zip(*rows))}

    return synced(call, device_of(model))


def build_pergrad_torch(workload, model, x, y) -> Call:
    """pergrad's per-example gradients of a loss function of one example (through
    ``functional_call``), as ``torch.func`` takes it: pergrad sees no layers, only a function."""
    import pergrad

    model, x_t, y_t = torch_inputs(model, x, y)
    params = detached_params(model)
    fn = pergrad.per_example_grads(loss_of_one(workload, model))
    return synced(lambda: fn(params, x_t, y_t), device_of(model))


def build_pergrad_module_torch(workload, model, x, y) -> Call:
    """pergrad's per-example gradients as its README writes them: ``module_loss`` of the model
    and the torch loss function itself (whose per-example losses pergrad knows, no vmap), the
    layers' own rules."""
    import pergrad

    model, x_t, y_t = torch_inputs(model, x, y)
    loss = pergrad.module_loss(model, torch_loss_function(workload))
    params = loss.params()
    fn = pergrad.per_example_grads(loss)
    return synced(lambda: fn(params, x_t, y_t), device_of(model))


def build_torch_write(workload, model, x, y) -> Call:
    shapes = result_shapes(model, x)
    device = device_of(model)

    def call() -> dict[str, torch.Tensor]:  # the default dtype: the model's, and its gradients'
        return {name: torch.full(shape, 1.0, device=device) for name, shape in shapes.items()}

    return synced(call, device_of(model))


def build_pergrad_norms_torch(workload, model, x, y) -> Call:
    import pergrad

    model, x_t, y_t = torch_inputs(model, x, y)
    loss = pergrad.module_loss(model, lambda out, t: torch_loss(workload, out, t))
    params = loss.params()

    def call() -> torch.Tensor:
        return pergrad.norms.per_example_norms_of(loss, params, x_t, y_t)

    return synced(call, device_of(model))


def build_torch_func(workload, model, x, y) -> Call:
    model, x_t, y_t = torch_inputs(model, x, y)
    params = detached_params(model)
    fn = torch.func.vmap(torch.func.grad(loss_of_one(workload, model)), in_dims=(None, 0, 0))
    return synced(lambda: fn(params, x_t, y_t), device_of(model))


def build_opacus_grad_sample(workload, model, x, y) -> Call:
    from opacus.grad_sample import GradSampleModule

    # Opacus's hooks capture nothing in eval mode; these models have no dropout or BatchNorm.
    model, x_t, y_t = torch_inputs(copy.deepcopy(model).train(), x, y)
    gsm = GradSampleModule(model, loss_reduction="mean")

    def call() -> dict[str, torch.Tensor]:
        gsm.zero_grad(set_to_none=True)
        torch_loss(workload, gsm(x_t), y_t).backward()
        return {name: p.grad_sample for name, p in gsm._module.named_parameters()}

    return synced(call, device_of(model))


def build_opacus_ghost_norms(workload, model, x, y) -> Call:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    model, x_t, y_t = torch_inputs(copy.deepcopy(model).train(), x, y)
    gsm = GradSampleModuleFastGradientClipping(
        model, loss_reduction="mean", use_ghost_clipping=True
    )

    def call() -> torch.Tensor:
        gsm.zero_grad(set_to_none=True)
        torch_loss(workload, gsm(x_t), y_t).backward()
        return gsm.get_norm_sample()

    return synced(call, device_of(model))


def build_backpack(extension: str) -> Callable[..., Call]:
    def build(workload, model, x, y) -> Call:
        from backpack import backpack, extend, extensions

        model, x_t, y_t = torch_inputs(extend(copy.deepcopy(model)), x, y)
        named = list(model.named_parameters())

        def call() -> Any:
            model.zero_grad(set_to_none=True)
            # Summed loss: BackPACK's per-example quantities are then those of each example's loss.
            with backpack(getattr(extensions, extension)()):
                torch_loss(workload, model(x_t), y_t, reduction="sum").backward()
            attribute = "grad_batch" if extension == "BatchGrad" else "batch_l2"
            unsupported = [name for name, p in named if not hasattr(p, attribute)]
            if unsupported:
                raise NotImplementedError(f"BackPACK left no {attribute} on {unsupported}")
            if extension == "BatchGrad":
                return {name: p.grad_batch for name, p in named}
            return torch.stack([p.batch_l2 for _, p in named]).sum(0).sqrt()

        return synced(call, device_of(model))

    return build


# --------------------------------------------------------------------------------------------
# JAX (always under jit).


def jax_setup(workload: Workload, model: nn.Module, x: np.ndarray, y: np.ndarray):
    """Parameters and batch committed to the JAX device of the model's kind (jit follows
    them), and the batch and single-example losses."""
    import jax

    device = jax_device(device_of(model))
    if device is None:
        raise RuntimeError(f"JAX has no {device_of(model).type} device: {jax.devices()}")

    def put(value: np.ndarray) -> Any:
        return jax.device_put(value, device)

    params = {name: put(p.detach().cpu().numpy()) for name, p in model.named_parameters()}

    def batch_loss(params, x, y):
        return jax_batch_loss(workload, workload.jax_forward(params, x), y)

    def one_loss(params, x, y):
        return batch_loss(params, x[None], y[None])

    return params, put(x), put(y), batch_loss, one_loss


def blocking(fn: Callable[..., Any], *args: Any) -> Call:
    import jax

    return lambda: jax.block_until_ready(fn(*args))


def build_jax_floor(workload, model, x, y) -> Call:
    import jax

    params, x_j, y_j, batch_loss, _ = jax_setup(workload, model, x, y)
    return blocking(jax.jit(jax.grad(batch_loss)), params, x_j, y_j)


def build_pergrad_jax(workload, model, x, y) -> Call:
    import jax

    import pergrad

    params, x_j, y_j, _, one_loss = jax_setup(workload, model, x, y)
    return blocking(jax.jit(pergrad.per_example_grads(one_loss)), params, x_j, y_j)


def build_jax_loop(workload, model, x, y) -> Call:
    import jax
    import jax.numpy as jnp

    params, x_j, y_j, _, one_loss = jax_setup(workload, model, x, y)
    one_grad = jax.jit(jax.grad(one_loss))

    def call() -> dict[str, Any]:
        rows = [one_grad(params, x_j[i], y_j[i]) for i in range(len(x_j))]
        return jax.block_until_ready(jax.tree.map(lambda *column: jnp.stack(column), *rows))

    return call


def build_jax_write(workload, model, x, y) -> Call:
    import jax
    import jax.numpy as jnp

    shapes = result_shapes(model, x)
    value = jax.device_put(np.float32(1.0), jax_device(device_of(model)))  # where jit runs

    @jax.jit
    def fill(value: Any) -> dict[str, Any]:  # an argument: XLA cannot fold it into constants
        return {name: jnp.full(shape, value, jnp.float32) for name, shape in shapes.items()}

    return blocking(fill, value)


def build_jax_vmap(workload, model, x, y) -> Call:
    import jax

    params, x_j, y_j, _, one_loss = jax_setup(workload, model, x, y)
    fn = jax.jit(jax.vmap(jax.grad(one_loss), in_axes=(None, 0, 0)))
    return blocking(fn, params, x_j, y_j)


def build_pergrad_norms_jax(workload, model, x, y) -> Call:
    import jax

    import pergrad

    params, x_j, y_j, _, one_loss = jax_setup(workload, model, x, y)

    def norms(params, x, y):
        return pergrad.norms.per_example_norms_of(one_loss, params, x, y)

    return blocking(jax.jit(norms), params, x_j, y_j)


LOOPS = {"torch": "torch loop", "jax": "jax loop"}  # each framework's speed-up reference
LOOP = LOOPS["torch"]  # the reference of every correctness check
METHODS = [
    Method("torch batch grad (floor)", "torch", "batch", (), build_torch_floor),
    Method("torch write B×P", "torch", "write", (), build_torch_write),
    Method(LOOP, "torch", "grads", (), build_torch_loop),
    Method("pergrad (torch)", "torch", "grads", ("pergrad",), build_pergrad_torch),
    Method(
        "pergrad module_loss (torch)", "torch", "grads", ("pergrad",), build_pergrad_module_torch
    ),
    Method("torch.func vmap(grad)", "torch", "grads", (), build_torch_func),
    Method("opacus GradSampleModule", "torch", "grads", ("opacus",), build_opacus_grad_sample),
    Method("opacus ghost norms", "torch", "norms", ("opacus",), build_opacus_ghost_norms),
    Method("backpack BatchGrad", "torch", "grads", ("backpack",), build_backpack("BatchGrad")),
    Method("backpack BatchL2Grad", "torch", "norms", ("backpack",), build_backpack("BatchL2Grad")),
    Method("pergrad norms (torch)", "torch", "norms", ("pergrad",), build_pergrad_norms_torch),
    Method("jax batch grad (floor)", "jax", "batch", ("jax",), build_jax_floor),
    Method("jax write B×P", "jax", "write", ("jax",), build_jax_write),
    Method(LOOPS["jax"], "jax", "grads", ("jax",), build_jax_loop),
    Method("pergrad (jax, jit)", "jax", "grads", ("jax", "pergrad"), build_pergrad_jax),
    Method("jax jit(vmap(grad))", "jax", "grads", ("jax",), build_jax_vmap),
    Method("pergrad norms (jax, jit)", "jax", "norms", ("jax", "pergrad"), build_pergrad_norms_jax),
]
METHODS_BY_NAME = {m.name: m for m in METHODS}
FLOORS = {m.framework: m.name for m in METHODS if m.kind == "batch"}
WRITES = {m.framework: m.name for m in METHODS if m.kind == "write"}


# --------------------------------------------------------------------------------------------
# Correctness against the loop.


def to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def norms_of(grads: dict[str, Any]) -> np.ndarray:
    flat = [to_numpy(g).reshape(len(to_numpy(g)), -1) for g in grads.values()]
    return np.sqrt(sum((f.astype(np.float64) ** 2).sum(1) for f in flat))


def max_abs_error(kind: str, result: Any, loop_grads: dict[str, Any]) -> float | None:
    """Max abs difference from the loop: grads leaf by leaf, norms, or the batch mean; None for
    the write of B x P numbers, which computes nothing."""
    if kind == "write":
        return None
    if kind == "norms":
        return float(np.max(np.abs(to_numpy(result) - norms_of(loop_grads))))
    reference = {k: to_numpy(v) for k, v in loop_grads.items()}
    if kind == "batch":
        reference = {k: v.mean(0) for k, v in reference.items()}
    return max(float(np.max(np.abs(to_numpy(result[k]) - reference[k]))) for k in reference)
