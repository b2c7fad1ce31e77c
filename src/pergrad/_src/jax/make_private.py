"""One call to set up DP-SGD in JAX: an optax transformation and a loader of padded
``(x, y, mask)`` batches that agree with each other and with the accountant (the numbers come
from ``dp/setup.py``)."""

from __future__ import annotations

import secrets
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pergrad._src.dp.clipping_policies import ClippingPolicy
from pergrad._src.dp.noise import NoiseMechanism
from pergrad._src.dp.sampling import warn_unsampled_batch
from pergrad._src.dp.setup import DEFAULT_ACCOUNTANT, DPSetup, PaddedPoissonLoader, plan
from pergrad._src.errors import PergradTypeError
from pergrad._src.jax.optax import optax_aggregate


def make_private_optax(
    *arrays: Any,
    batch_size: float | None,
    delta: float,
    max_norm: Any,
    epochs: float | None = None,
    steps: int | None = None,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    accountant: str = DEFAULT_ACCOUNTANT,
    noise: NoiseMechanism | None = None,
    clipping: ClippingPolicy | None = None,
    optimizer: optax.GradientTransformation | None = None,
    key: jax.Array | int | None = None,
    seed: int | None = None,
    max_batch_size: int | None = None,
) -> DPSetup:
    """DP-SGD for JAX in one call: the private optax transformation, a loader of padded
    Poisson batches that yields their mask, and the accountant, derived together.

    Example::

        tx, loader, accountant = pergrad.dp.make_private_optax(
            X, Y, batch_size=64, epochs=10, target_epsilon=3.0, delta=1e-5, max_norm=1.0,
            optimizer=optax.sgd(0.1))

        @jax.jit
        def step(params, state, x, y, mask):
            grads = pergrad.per_example_grads(loss)(params, x, y)   # loss of ONE example
            updates, state = tx.update(grads, state, params, mask=mask)
            return optax.apply_updates(params, updates), state

        state = tx.init(params)
        for epoch in range(10):
            for x, y, mask in loader:          # one padded shape: jit compiles once
                params, state = step(params, state, x, y, mask)
            print(accountant.epsilon())        # spent so far

    What it derives (:func:`pergrad.dp.plan`): ``sample_rate = batch_size / N``; the noise
    multiplier for ``target_epsilon`` over the run's steps with ``accountant``;
    :func:`pergrad.dp.optax_aggregate` dividing by ``expected_batch_size = batch_size`` (then
    ``optimizer``, chained, where given); and a :class:`pergrad.dp.PaddedPoissonLoader` of
    the arrays: Poisson batches at that rate (cyclic Poisson for a banded
    ``noise=pergrad.dp.toeplitz(..., sample_rate=)``), each padded to one size with its mask
    so that the mask travels with the batch, one epoch per pass, refusing a pass past the
    run; it steps the accountant at every batch it yields. For the ghost path without
    per-example gradients, call :func:`pergrad.dp.private_grad_of` with the same numbers
    (``setup.noise_multiplier``, ``setup.expected_batch_size``) and the loader's ``mask``.

    Args:
      *arrays: the dataset, arrays with the same leading axis ``N`` (JAX or numpy arrays;
        numpy ones are turned into JAX arrays once).
      batch_size, delta, epochs, steps, target_epsilon, noise_multiplier, accountant, noise:
        as for :func:`pergrad.dp.plan` (``accountant="pld"`` by default).
      max_norm: the clipping bound, or a pytree prefix of the gradients with per-group bounds,
        as for :func:`pergrad.dp.optax_aggregate`.
      clipping: the clipping policy, as for :func:`pergrad.dp.optax_aggregate`.
      optimizer: an optax transformation to chain after the private aggregate (None: the
        aggregate alone; chain it yourself).
      key: the noise's JAX key or int seed (None: a seed from ``secrets``).
      seed: the sampling's int seed (None: a secure random seed).
      max_batch_size: the padded size (None: :meth:`DPPlan.max_batch_size`).

    Returns:
      A :class:`pergrad.dp.DPSetup`: ``tx, loader, accountant = setup``, and
      ``setup.noise_multiplier``, ``.sample_rate``, ``.steps``, ``.epsilon()`` (the whole
      run's), ``.plan``.
    """
    fn = "make_private_optax"
    if not arrays:
        raise PergradTypeError(f"{fn}: pass the dataset's arrays (X, Y, ...); got none.")
    arrays = tuple(jnp.asarray(array) for array in arrays)
    run = plan(
        int(arrays[0].shape[0]) if arrays[0].ndim else 0,
        batch_size,
        delta=delta,
        epochs=epochs,
        steps=steps,
        target_epsilon=target_epsilon,
        noise_multiplier=noise_multiplier,
        accountant=accountant,
        noise=noise,
    )
    spent = run.make_accountant()
    aggregate = optax_aggregate(
        max_norm,
        run.noise_multiplier,
        secrets.randbits(63) if key is None else key,
        expected_batch_size=run.expected_batch_size,
        noise=run.noise,
        clipping=clipping,
    )
    aggregate = _needs_mask(aggregate)
    tx = aggregate if optimizer is None else optax.chain(aggregate, optimizer)
    loader = PaddedPoissonLoader(
        *arrays, plan=run, seed=seed, accountant=spent, max_batch_size=max_batch_size
    )
    return DPSetup(tx, loader, spent, run, max_norm)


def _needs_mask(aggregate: optax.GradientTransformationExtraArgs) -> Any:
    """``aggregate`` whose ``update`` says so (a :class:`pergrad.PrivacyWarning`) when it gets
    no ``mask``: the loader's batches always carry one, so such a batch was drawn otherwise
    (fixed-size batches), and the accounting does not cover it."""

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        if extra.get("mask") is None:
            warn_unsampled_batch("make_private_optax")
        return aggregate.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(aggregate.init, update)
