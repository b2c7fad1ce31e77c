"""pergrad quickstart: per-example gradients of one small model, in JAX and in PyTorch.

Run:  python examples/quickstart.py

For each framework it computes the gradient of every example's loss, checks that their mean is
the ordinary batch gradient, and prints a one-line summary of the per-example gradient norms.
"""

from __future__ import annotations

import numpy as np

import pergrad

BATCH, IN, HIDDEN, CLASSES = 32, 8, 16, 3


def make_data(seed: int = 0):
    rng = np.random.default_rng(seed)
    weights = {
        "w1": rng.normal(0, 0.5, size=(IN, HIDDEN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.normal(0, 0.5, size=(HIDDEN, CLASSES)).astype(np.float32),
    }
    x = rng.normal(size=(BATCH, IN)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=BATCH)
    return weights, x, y


def summarize(name: str, norms: np.ndarray, max_error: float) -> None:
    worst = int(np.argmax(norms))
    print(
        f"{name:>7}: grads for {len(norms)} examples; mean == batch gradient "
        f"(max abs diff {max_error:.1e}); norms mean {norms.mean():.3f}, "
        f"max {norms.max():.3f} (example {worst})"
    )


def jax_quickstart(weights, x, y) -> None:
    import jax
    import jax.numpy as jnp

    def loss(params, x, y):  # ONE example: x (IN,), y ()
        logits = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
        return -jax.nn.log_softmax(logits)[y]

    params = {k: jnp.asarray(v) for k, v in weights.items()}
    grads = jax.jit(pergrad.per_example_grads(loss))(params, x, jnp.asarray(y))
    # grads mirrors params: {"w1": (32, 8, 16), "b1": (32, 16), "w2": (32, 16, 3)}

    def batch_loss(params):
        return jax.vmap(loss, in_axes=(None, 0, 0))(params, x, y).mean()

    batch_grad = jax.grad(batch_loss)(params)
    error = max(float(jnp.abs(grads[k].mean(0) - batch_grad[k]).max()) for k in params)
    norms = jnp.sqrt(sum((g.reshape(BATCH, -1) ** 2).sum(1) for g in grads.values()))
    summarize("JAX", np.asarray(norms), error)


def torch_quickstart(weights, x, y) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES, bias=False))
    with torch.no_grad():  # the same weights as the JAX model
        model[0].weight.copy_(torch.from_numpy(weights["w1"].T))
        model[0].bias.copy_(torch.from_numpy(weights["b1"]))
        model[2].weight.copy_(torch.from_numpy(weights["w2"].T))

    loss = pergrad.module_loss(model, F.cross_entropy)  # loss(params, x, y) of ONE example
    x_t, y_t = torch.from_numpy(x), torch.from_numpy(y)
    grads = pergrad.per_example_grads(loss)(loss.params(), x_t, y_t)
    # grads: {"0.weight": (32, 16, 8), "0.bias": (32, 16), "2.weight": (32, 3, 16)}

    model.zero_grad()
    F.cross_entropy(model(x_t), y_t).backward()  # the ordinary batch gradient
    error = max((grads[k].mean(0) - p.grad).abs().max().item() for k, p in model.named_parameters())
    norms = torch.sqrt(sum((g.reshape(BATCH, -1) ** 2).sum(1) for g in grads.values()))
    summarize("PyTorch", norms.numpy(), error)


if __name__ == "__main__":
    weights, x, y = make_data()
    jax_quickstart(weights, x, y)
    torch_quickstart(weights, x, y)
