"""The benchmark workloads: a torch module and a JAX function of the same parameters each.

Every workload names its parameters as the torch module does (``"fc1.weight"``, ...) and the JAX
forward pass reads the same arrays in the same layout, so gradients compare one to one. JAX is
imported inside the JAX functions only: the torch half runs without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

Params = dict[str, Any]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    batch_size: int
    quick_batch_size: int
    make_model: Callable[[], nn.Module]
    make_data: Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]]
    loss: str  # "xent": output is logits (or log-probs), y class ids; "mse": y is (B, 1)
    jax_forward: Callable[[Params, Any], Any]  # (params, x batch) -> output batch


def torch_loss_function(workload: Workload) -> Callable[..., torch.Tensor]:
    """The ``torch.nn.functional`` loss of ``workload`` (cross-entropy takes logits or
    log-probs alike: log_softmax is idempotent)."""
    return F.mse_loss if workload.loss == "mse" else F.cross_entropy


def torch_loss(workload: Workload, output: torch.Tensor, y: torch.Tensor, reduction="mean"):
    return torch_loss_function(workload)(output, y, reduction=reduction)


def jax_batch_loss(workload: Workload, output: Any, y: Any) -> Any:
    import jax
    import jax.numpy as jnp

    if workload.loss == "mse":
        return jnp.mean((output - y) ** 2)
    log_probs = jax.nn.log_softmax(output)
    return -jnp.take_along_axis(log_probs, y[:, None], axis=1).mean()


# --------------------------------------------------------------------------------------------
# Data.


def images(shape: tuple[int, ...], classes: int = 10):
    def make(rng: np.random.Generator, b: int) -> tuple[np.ndarray, np.ndarray]:
        x = rng.normal(size=(b, *shape)).astype(np.float32)
        return x, rng.integers(0, classes, size=b)

    return make


def regression_data(dim: int):
    def make(rng: np.random.Generator, b: int) -> tuple[np.ndarray, np.ndarray]:
        x = rng.normal(size=(b, dim)).astype(np.float32)
        return x, rng.normal(size=(b, 1)).astype(np.float32)

    return make


def tokens(vocab: int, seq_len: int, classes: int):
    def make(rng: np.random.Generator, b: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.integers(0, vocab, size=(b, seq_len)), rng.integers(0, classes, size=b)

    return make


# --------------------------------------------------------------------------------------------
# The torch models.


class SimpleCNN(nn.Module):
    """The model of the PyTorch per-sample-gradients tutorial (with its log_softmax applied)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = torch.flatten(F.max_pool2d(x, 2), 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, 512)
        self.fc2 = nn.Linear(512, 512)
        self.fc3 = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class LinearRegression(nn.Module):
    def __init__(self, dim: int = 1000) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class SmallMLP(nn.Module):
    """256-128-10: small enough for a batch-size sweep up to 1024 on two CPU cores."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(256, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


VOCAB, SEQ_LEN, D_MODEL, HEADS, D_FF, CLASSES = 1000, 32, 64, 4, 128, 10


class TinyTransformer(nn.Module):
    """Token + position embeddings, one post-norm encoder layer, mean-pool, linear head
    (``width`` and ``seq_len``: another width, the feed-forward layer twice it, and positions).

    Attention is written with ``nn.Linear`` layers (not ``nn.MultiheadAttention``) so that
    Opacus's hooks support every parameter.
    """

    def __init__(self, width: int = D_MODEL, seq_len: int = SEQ_LEN) -> None:
        super().__init__()
        self.width = width
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(seq_len, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln1 = nn.LayerNorm(width)
        self.ff1 = nn.Linear(width, D_FF * width // D_MODEL)
        self.ff2 = nn.Linear(D_FF * width // D_MODEL, width)
        self.ln2 = nn.LayerNorm(width)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape
        d = self.width
        positions = torch.arange(t, device=x.device).expand(b, t)
        h = self.embed(x) + self.pos(positions)
        q, k, v = self.qkv(h).reshape(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-1, -2) / (d // HEADS) ** 0.5, dim=-1)
        attended = (weights @ v).transpose(1, 2).reshape(b, t, d)
        h = self.ln1(h + self.proj(attended))
        h = self.ln2(h + self.ff2(F.relu(self.ff1(h))))
        return self.head(h.mean(dim=1))


# --------------------------------------------------------------------------------------------
# The same models in JAX.


def jax_linear(params: Params, name: str, x: Any) -> Any:
    return x @ params[f"{name}.weight"].T + params[f"{name}.bias"]


def jax_layer_norm(params: Params, name: str, x: Any, eps: float = 1e-5) -> Any:
    import jax.numpy as jnp

    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    normed = (x - mean) / jnp.sqrt(var + eps)
    return normed * params[f"{name}.weight"] + params[f"{name}.bias"]


def jax_conv2d(params: Params, name: str, x: Any) -> Any:
    import jax

    out = jax.lax.conv_general_dilated(
        x,
        params[f"{name}.weight"],
        window_strides=(1, 1),
        padding="VALID",
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
    )
    return out + params[f"{name}.bias"][None, :, None, None]


def jax_max_pool2d(x: Any, size: int) -> Any:
    import jax
    import jax.numpy as jnp

    window = (1, 1, size, size)
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, window, window, "VALID")


def jax_cnn_log_probs(params: Params, x: Any) -> Any:
    import jax

    x = jax.nn.relu(jax_conv2d(params, "conv1", x))
    x = jax.nn.relu(jax_conv2d(params, "conv2", x))
    x = jax_max_pool2d(x, 2).reshape(x.shape[0], -1)
    x = jax.nn.relu(jax_linear(params, "fc1", x))
    return jax.nn.log_softmax(jax_linear(params, "fc2", x))


def jax_mlp_log_probs(params: Params, x: Any) -> Any:
    import jax

    x = jax.nn.relu(jax_linear(params, "fc1", x))
    x = jax.nn.relu(jax_linear(params, "fc2", x))
    return jax.nn.log_softmax(jax_linear(params, "fc3", x))


def jax_linreg(params: Params, x: Any) -> Any:
    return jax_linear(params, "fc", x)


def jax_small_mlp(params: Params, x: Any) -> Any:
    import jax

    return jax_linear(params, "fc2", jax.nn.relu(jax_linear(params, "fc1", x)))


def jax_transformer(params: Params, x: Any) -> Any:
    import jax
    import jax.numpy as jnp

    b, t = x.shape
    h = params["embed.weight"][x] + params["pos.weight"][jnp.arange(t)][None]
    qkv = jax_linear(params, "qkv", h).reshape(b, t, 3, HEADS, D_MODEL // HEADS)
    q, k, v = jnp.transpose(qkv, (2, 0, 3, 1, 4))
    weights = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / (D_MODEL // HEADS) ** 0.5, axis=-1)
    attended = jnp.swapaxes(weights @ v, 1, 2).reshape(b, t, D_MODEL)
    h = jax_layer_norm(params, "ln1", h + jax_linear(params, "proj", attended))
    ff = jax_linear(params, "ff2", jax.nn.relu(jax_linear(params, "ff1", h)))
    h = jax_layer_norm(params, "ln2", h + ff)
    return jax_linear(params, "head", h.mean(axis=1))


WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "cnn",
            "SimpleCNN of the PyTorch per-sample-grads tutorial, 1x28x28",
            64,
            8,
            SimpleCNN,
            images((1, 28, 28)),
            "xent",
            jax_cnn_log_probs,
        ),
        Workload(
            "mlp", "MLP 784-512-512-10", 256, 16, MLP, images((784,)), "xent", jax_mlp_log_probs
        ),
        Workload(
            "linreg",
            "linear regression, D=1000, squared error",
            1024,
            32,
            LinearRegression,
            regression_data(1000),
            "mse",
            jax_linreg,
        ),
        Workload(
            "transformer",
            f"1-layer transformer encoder (d={D_MODEL}, {HEADS} heads, vocab {VOCAB}), seq {SEQ_LEN}",
            32,
            4,
            TinyTransformer,
            tokens(VOCAB, SEQ_LEN, CLASSES),
            "xent",
            jax_transformer,
        ),
        Workload(
            "sweep",
            "batch-size sweep on an MLP 256-128-10",
            0,  # batch sizes come from SWEEP_BATCH_SIZES
            0,
            SmallMLP,
            images((256,)),
            "xent",
            jax_small_mlp,
        ),
    )
}

SWEEP_BATCH_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
QUICK_SWEEP_BATCH_SIZES = (8, 32)


def batch_sizes(workload: Workload, quick: bool) -> tuple[int, ...]:
    if workload.name == "sweep":
        return QUICK_SWEEP_BATCH_SIZES if quick else SWEEP_BATCH_SIZES
    return (workload.quick_batch_size if quick else workload.batch_size,)


def build(
    workload: Workload, batch_size: int, device: torch.device | str = "cpu"
) -> tuple[nn.Module, np.ndarray, np.ndarray]:
    """The seeded model (eval mode, on ``device``) and data (numpy, on the host): every process
    builds the same ones, on any device. The methods move the data to the model's device."""
    torch.manual_seed(0)
    model = workload.make_model().eval().to(device)  # initialised on the CPU: same weights
    x, y = workload.make_data(np.random.default_rng(0), batch_size)
    return model, x, y
