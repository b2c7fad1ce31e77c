"""Independent references for the tests: per-example gradients by a Python loop.

The loops use the frameworks' plain autodiff (``torch.autograd.grad`` / ``jax.grad``) on one
example at a time, with no vmap, so they share no code path with pergrad's vectorised core.
"""

from __future__ import annotations

from typing import Any


def torch_loop_grads(loss_of_one, params: dict, *batched: Any) -> dict:
    """``{name: (B, *shape)}`` from ``loss_of_one(params, *example)`` run example by example.

    ``params`` is a dict of tensors; each ``batched`` argument is a tensor batched on axis 0.
    """
    import torch

    names = list(params)
    batch_size = batched[0].shape[0]
    per_example = []
    for i in range(batch_size):
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        loss = loss_of_one(leaves, *(b[i] for b in batched))
        per_example.append(torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True))
    return {
        k: torch.stack(
            [g[j] if g[j] is not None else torch.zeros_like(params[k]) for g in per_example]
        )
        for j, k in enumerate(names)
    }


def jax_loop_grads(loss_of_one, params: Any, *batched: Any) -> Any:
    """Pytree like ``params`` with a leading batch axis, by ``jax.grad`` one example at a time."""
    import jax
    import jax.numpy as jnp

    batch_size = jax.tree_util.tree_leaves(batched)[0].shape[0]
    grad_fn = jax.jit(jax.grad(loss_of_one))
    per_example = [
        grad_fn(params, *jax.tree_util.tree_map(lambda b, i=i: b[i], batched))
        for i in range(batch_size)
    ]
    return jax.tree_util.tree_map(lambda *gs: jnp.stack(gs), *per_example)


def torch_loop_losses(loss_of_one, params: dict, *batched: Any) -> Any:
    """``(B,)`` losses from ``loss_of_one(params, *example)`` run example by example."""
    import torch

    batch_size = batched[0].shape[0]
    with torch.no_grad():
        return torch.stack(
            [loss_of_one(params, *(b[i] for b in batched)) for i in range(batch_size)]
        )


def torch_module_loop_grads(model, loss_fn, inputs: list, targets: list) -> dict:
    """``{name: (B, *shape)}`` by ordinary training code, one example at a time.

    A deep copy of ``model`` runs ``loss_fn(model(*inputs_i), *targets_i).backward()`` for each
    example ``i`` (batch axis of one kept), and its ``.grad`` fields are read: no
    ``functional_call``, no ``torch.func``, no ``autograd.grad`` (which reentrant checkpointing
    refuses). A dict input is passed as keyword arguments. Tied parameters appear once, under
    their first name, with the sum of both uses, as autograd gives.
    """
    import copy

    import torch

    def row(x, i):
        if isinstance(x, dict):
            return {k: row(v, i) for k, v in x.items()}
        return x[i : i + 1]

    clone = copy.deepcopy(model)
    params = dict(clone.named_parameters())
    batch_size = (
        next(iter(targets[0].values())).shape[0]
        if isinstance(targets[0], dict)
        else len(targets[0])
    )
    per_example = {name: [] for name in params}
    for i in range(batch_size):
        for p in params.values():
            p.grad = None
        args = [row(x, i) for x in inputs]
        positional = [x for x in args if not isinstance(x, dict)]
        keywords = {k: v for x in args if isinstance(x, dict) for k, v in x.items()}
        loss = loss_fn(clone(*positional, **keywords), *(row(t, i) for t in targets))
        loss.backward()
        for name, p in params.items():
            per_example[name].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    return {name: torch.stack(gs) for name, gs in per_example.items()}


def torch_flat_norms(grads: dict) -> Any:
    """``(B,)`` float64 numpy norms of per-example gradients ``{name: (B, ...)}``, all together."""
    import torch

    batch = next(iter(grads.values())).shape[0]
    flat = torch.cat([g.double().reshape(batch, -1) for g in grads.values()], 1)
    return flat.norm(dim=1).cpu().numpy()


def torch_clipped_sum(grads: dict, max_norm: float) -> dict:
    """``{name: sum_i min(1, max_norm / |g_i|) g_i}`` in float64 numpy, by hand."""
    import numpy as np

    factors = np.minimum(1.0, max_norm / np.maximum(torch_flat_norms(grads), 1e-30))
    return {k: np.tensordot(factors, g.double().cpu().numpy(), axes=1) for k, g in grads.items()}


def assert_updates_close(got: dict, want: dict, rtol: float) -> None:
    """Per parameter, error <= rtol x its norm, plus 1e-6 of the whole update (a parameter whose
    exact gradient is zero, such as an attention's key bias, holds rounding noise)."""
    import numpy as np

    assert set(got) == set(want)
    floor = 1e-6 * float(np.sqrt(sum(float((w**2).sum()) for w in want.values())))
    for name, w in want.items():
        error = float(np.linalg.norm(got[name] - w))
        assert error <= rtol * float(np.linalg.norm(w)) + floor, (
            f"{name}: error {error:.2e}, norm {np.linalg.norm(w):.2e}"
        )
