"""One step of a training run, replayed and differentiated in PyTorch (``metagradient.py``).

Everything goes through ``torch.func`` on the flat parameter vector (a copy): the model's
parameters, buffers, ``.grad`` fields and ``requires_grad`` flags are never touched. The
optimizer state is a tuple of ``(P,)`` tensors (SGD's velocity, Adam's moments).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from pergrad._src.core.module_loss import ModuleLoss, refuse_batch_mixing_layers
from pergrad._src.errors import PergradTypeError, PergradValueError


def safe_sqrt(x: Any) -> Any:
    """``sqrt(x)`` whose derivative at 0 is 0 instead of infinity (see ``adam``)."""
    positive = x > 0
    return torch.where(positive, torch.sqrt(torch.where(positive, x, torch.ones_like(x))), 0.0)


def refuse_random_layers(model: nn.Module, caller: str) -> None:
    """Raise if ``model`` has a layer whose output is random (dropout in training mode)."""
    refuse_batch_mixing_layers(model, caller)
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0:
            raise PergradValueError(
                f"{caller}: layer {name!r} ({type(module).__name__}, p={module.p}) is in "
                f"training mode, so the run cannot be replayed exactly (each replay would draw "
                f"other masks). Call model.eval() before module_loss, or set p=0."
            )


class Replay:
    """The PyTorch side of a :class:`~pergrad._src.influence.metagradient.Run`."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.unravel = run.flat.unravel
        self.optimizer = run.optimizer
        self.kept = run.normalize == "kept"
        if isinstance(run.loss, ModuleLoss):
            refuse_random_layers(run.loss.model, run.caller)
        self.device = run.flat.vector.device
        self.dtype = run.flat.vector.dtype
        self._check_loss()

    def _check_loss(self) -> None:
        example = tuple(x[0] for x in self._batch_of(torch.zeros(1, dtype=torch.long)))
        value = self._guarded(lambda: self.run.loss(self.unravel(self.run.flat.vector), *example))
        problem = self.run.backend.scalar_loss_problem(value)
        if problem is not None:
            raise PergradValueError(
                f"{self.run.caller}: loss must return a scalar for one example; got {problem}."
            )

    def _guarded(self, compute: Callable[[], Any]) -> Any:
        try:
            return compute()
        except RuntimeError as err:
            if "random" not in str(err).lower():
                raise
            raise PergradValueError(
                f"{self.run.caller}: the loss draws random numbers ({err}), so the run cannot "
                f"be replayed exactly; make it deterministic (model.eval(), no dropout)."
            ) from err

    def check_target(self, target: Any) -> None:
        if not callable(target):
            raise PergradTypeError(
                f"{self.run.caller}: target must be a function target(params) -> scalar or "
                f"(k,); got {type(target).__name__}."
            )
        value = self._guarded(lambda: target(self.unravel(self.run.flat.vector)))
        if not (isinstance(value, torch.Tensor) and value.dim() <= 1 and value.is_floating_point()):
            got = (
                f"shape {tuple(value.shape)} of {value.dtype}"
                if isinstance(value, torch.Tensor)
                else type(value).__name__
            )
            raise PergradValueError(
                f"{self.run.caller}: target(params) must return a float scalar or a (k,) "
                f"tensor; got {got}."
            )
        self.target = target
        self.num_targets = max(value.numel(), 1) if value.dim() else 1

    # -- the pieces of one step -----------------------------------------------------------

    def init_state(self) -> tuple[Any, ...]:
        return tuple(self.optimizer.init(self.run.flat.vector))

    def _batch_of(self, index: Any) -> tuple[Any, ...]:
        index = index.to(self.device)
        leaves, spec = torch.utils._pytree.tree_flatten(self.run.data)
        gathered = [leaf[index.to(leaf.device)] for leaf in leaves]
        return torch.utils._pytree.tree_unflatten(gathered, spec)

    def _batch(self, step: int) -> tuple[Any, ...]:
        return self._batch_of(torch.as_tensor(self.run.batches[step]))

    def _losses(self, params: Any, batch: tuple[Any, ...]) -> Any:
        def one(example: tuple[Any, ...]) -> Any:
            return self.run.loss(self.unravel(params), *example)

        return torch.func.vmap(one)(batch)

    def _update(self, hyper: Any, params: Any, state: tuple, grad: Any) -> Any:
        return self.optimizer.update(safe_sqrt, hyper, params, tuple(state), grad)

    def step(self, step: int, params: Any, state: tuple, weights: np.ndarray) -> Any:
        total = len(weights) if not self.kept else float(np.sum(weights))
        if len(weights) == 0 or total == 0:
            return params, state
        scale = torch.as_tensor(weights / total, dtype=self.dtype, device=self.device)
        batch = self._batch(step)

        def batch_loss(p: Any) -> Any:
            return (scale * self._losses(p, batch)).sum()

        grad = self._guarded(lambda: torch.func.grad(batch_loss)(params))
        return self._update(self.run.hyper(step), params, state, grad)

    def target_rows(self, params: Any, state: tuple) -> Any:
        def target(p: Any) -> Any:
            return self.target(self.unravel(p)).reshape(-1)

        rows = torch.func.jacrev(target)(params)
        return rows, tuple(
            torch.zeros(rows.shape[0], *x.shape, dtype=x.dtype, device=x.device) for x in state
        )

    def reverse_step(self, step, params, state, adjoint_params, adjoint_state):
        batch, hyper = self._batch(step), self.run.hyper(step)
        size = len(self.run.batches[step])

        def mean_and_losses(p: Any) -> Any:
            losses = self._losses(p, batch)
            return losses.mean(), losses

        grad_and_losses = torch.func.grad(mean_and_losses, has_aux=True)
        grad, _ = grad_and_losses(params)

        def update(p: Any, s: tuple, g: Any) -> Any:
            return self._update(hyper, p, s, g)

        _, update_vjp = torch.func.vjp(update, params, tuple(state), grad)
        a_params, a_state, a_grad = torch.func.vmap(update_vjp)(
            (adjoint_params, tuple(adjoint_state))
        )

        def fused(tangent: Any) -> Any:
            return torch.func.jvp(grad_and_losses, (params,), (tangent,))[1]

        hessian_rows, directional = torch.func.vmap(fused)(a_grad)  # (k, P), (k, B)
        terms = directional / size
        if self.kept:
            terms = terms - terms.mean(dim=1, keepdim=True)
        return a_params + hessian_rows, tuple(a_state), terms

    def zero_scores(self) -> Any:
        shape = (self.run.num_train, self.num_targets)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def add_scores(self, scores: Any, step: int, terms: Any) -> Any:
        index = torch.as_tensor(self.run.batches[step], device=self.device)
        return scores.index_add(0, index, terms.T)

    def finish(self, scores: Any) -> Any:
        return scores.detach()
