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


def _over_targets(function: Callable[[Any], Any], rows: Any) -> Any:
    """``function`` of each target's row of ``rows`` (a pytree, each leaf ``(k, ...)``), the
    results stacked (each leaf ``(k, ...)``). One target's row is passed directly: vmap's own
    cost per call matches the arithmetic's on a small model (a sixth of a reverse step)."""
    leaves, spec = torch.utils._pytree.tree_flatten(rows)
    if leaves[0].shape[0] != 1:
        return torch.func.vmap(function)(rows)
    out = function(torch.utils._pytree.tree_unflatten([x[0] for x in leaves], spec))
    return torch.utils._pytree.tree_map(lambda x: x[None], out)


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

    def _batch_grad(self, params: Any, scale: Any, batch: tuple[Any, ...]) -> Any:
        """The gradient of ``sum_i scale_i * loss_i`` over ``batch`` (``scale``: ``(B,)``)."""
        return torch.func.grad(lambda p: (scale * self._losses(p, batch)).sum())(params)

    def step(self, step: int, params: Any, state: tuple, weights: np.ndarray) -> Any:
        total = len(weights) if not self.kept else float(np.sum(weights))
        if len(weights) == 0 or total == 0:
            return params, state
        scale = torch.as_tensor(weights / total, dtype=self.dtype, device=self.device)
        batch = self._batch(step)
        grad = self._guarded(lambda: self._batch_grad(params, scale, batch))
        return self._update(self.run.hyper(step), params, state, grad)

    def target_rows(self, params: Any, state: tuple) -> Any:
        def target(p: Any) -> Any:
            return self.target(self.unravel(p)).reshape(-1)

        rows = torch.func.jacrev(target)(params)
        return rows, tuple(
            torch.zeros(rows.shape[0], *x.shape, dtype=x.dtype, device=x.device) for x in state
        )

    def reverse_step(self, step, params, state, adjoint_params, adjoint_state):
        """The adjoints before step ``step`` and each example's term, ``(k, len(batch))``.

        The step is differentiated as a function of the parameters, the optimizer state and
        the examples' scales in the batch loss (``1 / len(batch)`` each): one vector-Jacobian
        product along the ``k`` adjoints (reverse-over-reverse) gives the adjoints before the
        step, the Hessian-vector product included, and each example's term, the scales' part.
        On CPU this costs half of forward-over-reverse plus a gradient (issue 34).
        """
        batch, hyper = self._batch(step), self.run.hyper(step)
        size = len(self.run.batches[step])
        scale = torch.full((size,), 1.0 / size, dtype=self.dtype, device=self.device)

        def one_step(p: Any, s: tuple, scales: Any) -> Any:
            return self._update(hyper, p, s, self._batch_grad(p, scales, batch))

        _, step_vjp = torch.func.vjp(one_step, params, tuple(state), scale)
        a_params, a_state, scale_rows = _over_targets(
            step_vjp, (adjoint_params, tuple(adjoint_state))
        )
        terms = scale_rows / size  # d/dw_i, w_i = size * scale_i
        if self.kept:
            terms = terms - terms.mean(dim=1, keepdim=True)
        return a_params, tuple(a_state), terms

    def zero_scores(self) -> Any:
        shape = (self.run.num_train, self.num_targets)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def add_scores(self, scores: Any, step: int, terms: Any) -> Any:
        index = torch.as_tensor(self.run.batches[step], device=self.device)
        return scores.index_add(0, index, terms.T)

    def finish(self, scores: Any) -> Any:
        return scores.detach()
