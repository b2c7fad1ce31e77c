"""The outputs attribution scores for classification, written so they stay vectorised.

TRAK (and any score of an output rather than a loss) wants each example's *margin*,
``logit_y - logsumexp(logits without y)``, and TRAK's optional weight ``Q = 1 - p_y``. Written
the natural way, ``logits[y]``, a PyTorch function indexes a tensor by a batched label, which
``torch.func.vmap`` cannot vectorise: pergrad falls back to one example at a time (several
times slower, with a ``FallbackWarning``). These helpers select the label's entry with a
comparison against ``arange`` instead, which both frameworks vectorise, and work on either
framework's arrays.
"""

from __future__ import annotations

from typing import Any

from pergrad._src.errors import PergradTypeError, PergradValueError


def _label_mask(func_name: str, logits: Any, label: Any) -> tuple[Any, Any]:
    """``(ops, mask)``: the array module of ``logits`` and ``arange(C) == label``."""
    module = type(logits).__module__
    if module.startswith("torch"):
        import torch

        if logits.ndim != 1:
            raise PergradValueError(
                f"{func_name}: logits must be the (C,) logits of ONE example; got shape "
                f"{tuple(logits.shape)} (write the output of one example: pergrad maps it over "
                f"the batch)."
            )
        return torch, torch.arange(logits.shape[0], device=logits.device) == label
    if module.startswith("jax"):
        import jax.numpy as jnp

        if logits.ndim != 1:
            raise PergradValueError(
                f"{func_name}: logits must be the (C,) logits of ONE example; got shape "
                f"{tuple(logits.shape)} (write the output of one example: pergrad maps it over "
                f"the batch)."
            )
        return _JaxOps(jnp), jnp.arange(logits.shape[0]) == label
    raise PergradTypeError(
        f"{func_name}: logits must be a torch tensor or a JAX array; got {type(logits).__name__}."
    )


class _JaxOps:
    """``jax.numpy`` with ``logsumexp`` (which lives in ``jax.nn``), as torch has it."""

    def __init__(self, jnp: Any) -> None:
        import jax

        self.where, self.zeros_like, self.full_like, self.exp = (
            jnp.where,
            jnp.zeros_like,
            jnp.full_like,
            jnp.exp,
        )
        self.logsumexp = jax.nn.logsumexp


def classification_margin(logits: Any, label: Any) -> Any:
    """``logits[label] - logsumexp(the other logits)`` of one example, vectorisable.

    The output TRAK attributes for classification (Park et al. 2023): positive when the
    example is classified correctly, and its gradient is the loss's up to the weight
    :func:`classification_weight`. Use it inside the output of one example::

        def margin(params, x, y):
            return pergrad.influence.classification_margin(model(params, x), y)

    Args:
      logits: ``(C,)`` logits of one example (torch or JAX).
      label: its class, an integer scalar (batched by pergrad).

    Returns:
      A scalar of the logits' framework.
    """
    ops, mask = _label_mask("classification_margin", logits, label)
    correct = ops.where(mask, logits, ops.zeros_like(logits)).sum()
    others = ops.where(mask, ops.full_like(logits, -float("inf")), logits)
    return correct - ops.logsumexp(others, 0)


def classification_weight(logits: Any, label: Any) -> Any:
    """TRAK's weight ``Q = 1 - p_label`` of one example, vectorisable (see
    :func:`classification_margin`). On a well-fit model it is near 0 for most training
    examples and large for the few it gets wrong, so those few dominate every target's
    proponents: ``pergrad.influence.trak``'s default (no weight) gives proponents of the
    target's class far more often (the influence guide has the measurement).

    Returns:
      A scalar of the logits' framework.
    """
    ops, mask = _label_mask("classification_weight", logits, label)
    probabilities = ops.exp(logits - ops.logsumexp(logits, 0))
    return 1 - ops.where(mask, probabilities, ops.zeros_like(probabilities)).sum()
