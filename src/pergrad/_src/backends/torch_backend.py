"""The PyTorch backend: ``torch.func.vmap`` / ``torch.func.grad_and_value`` and torch's pytrees."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from pergrad._src.backends import runs_vectorised
from pergrad._src.backends.secure import is_secure
from pergrad._src.errors import PergradValueError

# A draw of more numbers than this on a CPU is made in chunks of this many, each from its own
# generator seeded from rng (one seed a chunk, drawn from rng first, in order), the chunks on up
# to torch's intra-op thread count of threads at once: torch's CPU normal_ runs on one core, and
# GPT-2 small's noise (124 M numbers) took 0.33 s of a 5.5 s DP step on 2 cores. The numbers
# depend on the draw's size only, not on the threads; a smaller draw is torch.randn's.
NOISE_CHUNK_NUMBERS = 2**20


def _chunked_normal(rng: Any, like: Any) -> Any:
    """Standard normal numbers shaped like ``like`` (in its dtype, on the CPU): chunk ``k`` of
    :data:`NOISE_CHUNK_NUMBERS` from a generator seeded with the ``k``-th of the seeds drawn
    from ``rng`` (``torch.randint`` below ``2**62``; None: torch's global generator)."""
    count = -(-like.numel() // NOISE_CHUNK_NUMBERS)
    seeds = torch.randint(2**62, (count,), generator=rng, dtype=torch.int64, device="cpu")
    seeds = seeds.tolist()
    out = torch.empty(like.numel(), dtype=like.dtype, device="cpu")
    chunks = out.split(NOISE_CHUNK_NUMBERS)

    def draw(k: int) -> None:
        chunks[k].normal_(generator=torch.Generator(device="cpu").manual_seed(seeds[k]))

    workers = min(count, torch.get_num_threads())
    if workers > 1:  # normal_ lets go of the GIL: the chunks are drawn side by side
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(draw, range(count)))
    else:
        for k in range(count):
            draw(k)
    return out.view(like.shape)


class TorchBackend:
    name = "torch"
    supports_randomness = True

    def is_array(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def owns(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def flatten(self, tree: Any) -> tuple[list[str], list[Any], Any]:
        with_paths, treedef = pytree.tree_flatten_with_path(tree)
        paths = [pytree.keystr(path) for path, _ in with_paths]
        leaves = [leaf for _, leaf in with_paths]
        return paths, leaves, treedef

    def leaves(self, tree: Any) -> list[Any]:
        return pytree.tree_leaves(tree)

    # Shortcuts for the two shapes of nearly every call, a tensor and a flat dict of tensors
    # (named_parameters()): torch's pytree walk is Python, and on a small model it costs as much
    # as the gradients. The results are those of pytree.tree_flatten / tree_unflatten.

    def flatten_leaves(self, tree: Any) -> tuple[list[Any], Any]:
        if isinstance(tree, torch.Tensor):
            return [tree], _LEAF
        if type(tree) is dict and all(isinstance(x, torch.Tensor) for x in tree.values()):
            return list(tree.values()), pytree.TreeSpec(dict, list(tree), [_LEAF] * len(tree))
        return pytree.tree_flatten(tree)

    def unflatten(self, treedef: Any, leaves: Sequence[Any]) -> Any:
        if treedef.is_leaf():
            return leaves[0]
        if treedef.type is dict and treedef.num_nodes == treedef.num_leaves + 1 == len(leaves) + 1:
            return dict(zip(treedef.context, leaves))
        return pytree.tree_unflatten(list(leaves), treedef)

    def broadcast_prefix(self, prefix: Any, tree: Any) -> list[Any] | None:
        return pytree._broadcast_to_and_flatten(prefix, pytree.tree_structure(tree))

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(x.shape)

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype).removeprefix("torch.")

    def is_inexact(self, x: Any) -> bool:
        return x.is_floating_point() or x.is_complex()

    def as_differentiable(self, x: Any) -> Any:
        return torch.tensor(float(x), dtype=torch.get_default_dtype())

    def constant_leaves(self, tree: Any) -> frozenset[int]:
        return frozenset()

    def moveaxis_to_front(self, x: Any, axis: int) -> Any:
        return torch.movedim(x, axis, 0)

    def value_and_grad(self, fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
        grad_and_value = torch.func.grad_and_value(fn, argnums=0, has_aux=has_aux)

        def value_and_grad(*args: Any) -> Any:
            grads, value = grad_and_value(*args)
            return value, grads

        return value_and_grad

    def loop_value_and_grad(self, fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
        # Plain autograd rather than torch.func: it also runs what function transforms refuse
        # (full backward hooks, autograd.Functions without a vmap rule).
        def value_and_grad(diff: tuple[Any, ...], example: tuple[Any, ...]) -> Any:
            leaves = tuple(x.detach().requires_grad_(True) for x in diff)
            with torch.enable_grad():
                out = fn(leaves, example)
                loss = out[0] if has_aux else out
                try:
                    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
                except RuntimeError as err:
                    if "use_reentrant=True" not in str(err):
                        raise
                    raise PergradValueError(
                        "per_example_grads: fn uses activation checkpointing with "
                        "use_reentrant=True, which torch cannot differentiate with "
                        "torch.autograd.grad, so no loop over examples can run it. Use "
                        "use_reentrant=False (PyTorch's recommendation; Hugging Face: "
                        "gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                        "{'use_reentrant': False})), or, for a pergrad.module_loss whose layers "
                        "all have rules, strategy='hooks'."
                    ) from err
            grads = tuple(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads))
            value = (loss.detach(), _detach(out[1])) if has_aux else loss.detach()
            return value, grads

        return value_and_grad

    def match_varying(self, diff: tuple[Any, ...], batched: tuple[Any, ...]) -> tuple[Any, ...]:
        del batched  # only JAX's shard_map tracks what varies over devices
        return diff

    def rng_state(self) -> Any:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        return torch.random.get_rng_state(), cuda

    def set_rng_state(self, state: Any) -> None:
        cpu, cuda = state
        torch.random.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)

    def rng_state_changed(self, state: Any) -> bool:
        now = self.rng_state()
        return not (
            torch.equal(now[0], state[0])
            and len(now[1]) == len(state[1])
            and all(torch.equal(a, b) for a, b in zip(now[1], state[1]))
        )

    def vmap(
        self,
        fn: Callable[..., Any],
        in_axes: tuple[Any, ...],
        chunk_size: int | None,
        randomness: str | None,
    ) -> Callable[..., Any]:
        return torch.func.vmap(
            runs_vectorised(fn),
            in_dims=in_axes,
            randomness=randomness or "error",
            chunk_size=chunk_size,
        )

    def take(self, x: Any, index: int) -> Any:
        return x[index]

    def stack(self, xs: Sequence[Any]) -> Any:
        return torch.stack(list(xs))

    def zeros_example(self, x: Any) -> Any:
        return torch.zeros((1, *x.shape[1:]), dtype=x.dtype, device=x.device)

    def slice_empty(self, x: Any) -> Any:
        return x[:0]

    def explain_failure(self, err: Exception) -> Exception | None:
        """A clear error for failures a loop would not fix; None to let the core fall back."""
        message = str(err)
        if "randomness" in message and "vmap" in message:
            return PergradValueError(
                "per_example_grads: fn draws random numbers (e.g. dropout) inside vmap. Pass "
                "randomness='different' for independent randomness per example (what a loop "
                "over examples gives), randomness='same' for one draw shared by the batch, or "
                "call model.eval() to switch dropout off."
            )
        if "mutate a captured Tensor" in message:
            return PergradValueError(
                "per_example_grads: fn writes in place into a tensor it captured instead of "
                "receiving it as an argument; most often BatchNorm in training mode updating "
                "its running statistics. BatchNorm in training mode mixes the examples of a "
                "batch, so per-example gradients are not defined: call model.eval() or use "
                "GroupNorm / LayerNorm. Otherwise pass the tensor as an argument of fn. "
                f"(torch: {message.splitlines()[0][:160]})"
            )
        return None

    def to_numpy(self, x: Any) -> Any:
        return x.detach().cpu().numpy()

    def from_numpy(self, x: Any, like: Any) -> Any:
        return torch.as_tensor(x, device=like.device if isinstance(like, torch.Tensor) else None)

    def standard_normal(self, rng: Any, like: Any) -> Any:
        if is_secure(rng):  # the OS's cryptographic source, on the host
            values = rng.normal(tuple(like.shape))
            return torch.from_numpy(values).to(device=like.device, dtype=like.dtype)
        # torch.randn refuses a generator of another device (a CPU generator for CUDA noise):
        # draw on the generator's device, then move the draw to like's.
        device = like.device if rng is None else rng.device
        if torch.device(device).type == "cpu" and like.numel() > NOISE_CHUNK_NUMBERS:
            return _chunked_normal(rng, like).to(like.device)
        draw = torch.randn(like.shape, generator=rng, dtype=like.dtype, device=device)
        return draw.to(like.device)

    def add_scaled(
        self, xs: Sequence[Any], noises: Sequence[Any], scale: float, in_place: Sequence[bool]
    ) -> list[Any]:
        if not xs:
            return []
        torch._foreach_mul_(list(noises), scale)  # scale * noise, rounded, as one op would
        result = list(xs)
        owned = [k for k, own in enumerate(in_place) if own]
        others = [k for k, own in enumerate(in_place) if not own]
        if owned:
            targets = [xs[k].detach() for k in owned]
            torch._foreach_add_(targets, [noises[k] for k in owned])
            for k, target in zip(owned, targets):
                result[k] = target
        if others:
            added = torch._foreach_add([xs[k] for k in others], [noises[k] for k in others])
            for k, value in zip(others, added):
                result[k] = value
        return result

    def split_key(self, rng: Any, num: int) -> Any:
        return [rng] * num  # a torch.Generator (or a SecureRandom) advances by itself

    def scalar_loss_problem(self, loss: Any) -> str | None:
        if not isinstance(loss, torch.Tensor):
            return f"an object of type {type(loss).__name__}"
        if loss.dim() != 0:
            return f"a tensor of shape {tuple(loss.shape)}"
        if not loss.is_floating_point():
            return f"a scalar of dtype {self.dtype_name(loss)}"
        return None

    def hvp(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        # Reverse-over-reverse (the vjp of the gradient): one forward and backward, then a
        # batched second backward for all tangents. Double backward covers more torch ops than
        # forward-mode AD does; the Hessian is symmetric, so the vjp is the Hessian product.
        def hvp_rows(x: Any, tangents: Any, *args: Any) -> Any:
            _, vjp_fn = torch.func.vjp(lambda y: torch.func.grad(fn)(y, *args), x)
            return torch.func.vmap(lambda tangent: vjp_fn(tangent)[0])(tangents)

        return hvp_rows

    def eye(self, n: int, like: Any) -> Any:
        return torch.eye(n, dtype=like.dtype, device=like.device)

    def eigh(self, matrix: Any) -> tuple[Any, Any]:
        return torch.linalg.eigh(matrix)

    def cholesky(self, matrix: Any) -> Any | None:
        factor, info = torch.linalg.cholesky_ex(matrix)
        return factor if int(info) == 0 and bool(torch.isfinite(factor).all()) else None

    def cholesky_solve(self, factor: Any, rows: Any) -> Any:
        return torch.cholesky_solve(rows.T, factor).T

    def concatenate(self, xs: Sequence[Any], axis: int) -> Any:
        return torch.cat(list(xs), dim=axis)

    def stop_gradient(self, x: Any) -> Any:
        return x.detach()

    def isfinite(self, x: Any) -> Any:
        return torch.isfinite(x)

    def where(self, condition: Any, x: Any, y: Any) -> Any:
        return torch.where(condition, x, y)

    def known_all(self, condition: Any) -> bool | None:
        if torch.compiler.is_compiling():
            return None
        try:
            return bool(condition.all())
        except RuntimeError:  # a batched tensor of a torch.func transform has no one value
            return None


_LEAF = pytree.tree_structure(torch.empty(0))


def _detach(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)


BACKEND = TorchBackend()
