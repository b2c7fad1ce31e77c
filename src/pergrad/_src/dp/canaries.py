"""Canaries for auditing a DP training run, and the auditor that runs one and reads the bound.

    canaries = GradientCanaries(initial_params, count=1000, sample_rate=q, seed=audit_seed)
    report = audit(lambda c: my_training(c), canaries, noise_multiplier=1.0,
                   sample_rate=q, steps=T, delta=1e-5)
    report.violated      # True: the lower bound exceeds the accountant's epsilon

Two kinds of canaries, each included in training by its own fair coin, drawn from a seed the
auditor keeps (training must never see the coins, only the included canaries):

* :class:`GradientCanaries` (white-box): each canary is a fixed gradient, injected as one
  example's per-example gradient in the steps that sample it; the score is how far the final
  parameters moved against that gradient. It tests the clip-sum-noise aggregate itself, with
  no data or model in the way: the strongest attack on DP-SGD's analysis.
* :class:`InputCanaries` (black-box): each canary is an input with a wrong label, inserted into
  the training set; the score is how well the final model fits the wrong label. It tests the
  whole pipeline (sampling, batching, any layer that escapes clipping) but is weaker.

The canaries and the statistics are framework-free; gradient canaries build their gradients in
the framework of the parameters they are given (JAX or PyTorch), imported when used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pergrad._src.backends import backend_of
from pergrad._src.dp.accounting import check_count, check_sample_rate
from pergrad._src.dp.accounting import epsilon as accountant_epsilon
from pergrad._src.dp.audit import (
    epsilon_lower_bound,
    epsilon_lower_bound_ceiling,
    score_array,
)
from pergrad._src.dp.audit_many_runs import auroc
from pergrad._src.dp.noise import NoiseMechanism
from pergrad._src.errors import PergradTypeError, PergradValueError

# Streams of the user's seed: the coins, the directions (or labels), the per-step sampling.
_COINS, _DESIGN, _SAMPLING = 0, 1, 2


def _rng(seed: int, stream: int, *more: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, *more])


def _check_seed(fn: str, seed: Any) -> int:
    return check_count(fn, "seed", seed, minimum=0)


class _Coins:
    """One fair coin per canary, from the auditor's seed, and the split of scores by them."""

    def __init__(self, fn: str, count: Any, seed: Any) -> None:
        self.count = check_count(fn, "count", count, minimum=2)
        self.seed = _check_seed(fn, seed)
        self.included = _rng(self.seed, _COINS).random(self.count) < 0.5
        self.included.setflags(write=False)

    @property
    def num_included(self) -> int:
        return int(self.included.sum())

    def split(self, scores: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(in_scores, out_scores)``: the ``(count,)`` scores of the canaries, by coin."""
        values = score_array(f"{type(self).__name__}.split", "scores", scores)
        if values.shape != (self.count,):
            raise PergradValueError(
                f"{type(self).__name__}.split: scores must have one score per canary, shape "
                f"({self.count},), in the canaries' order; got shape {values.shape}."
            )
        return values[self.included], values[~self.included]


class GradientCanaries(_Coins):
    """White-box canaries: fixed per-example gradients, injected into DP-SGD's aggregate.

    Example (JAX; PyTorch is the same with tensors)::

        canaries = GradientCanaries(params, count=1000, sample_rate=q, seed=audit_seed)
        pad = pergrad.dp.max_batch_size_for(canaries.num_included, q)  # one shape for jit
        for step, batch in enumerate(batches):
            grads = per_example(params, x[batch], y[batch])          # leaves (B, ...)
            grads, mask = canaries.inject(grads, mask, step, pad_to=pad)  # + (pad, ...)
            updates, state = tx.update(grads, state, params, mask=mask)
        scores = canaries.scores(params, reference=params_of_a_run_without_canaries)

    ``inject`` runs outside ``jax.jit`` (it draws the step's canaries on the host); the
    clipping and noise after it can be jitted.

    Canary ``i`` is the gradient ``norm * u_i`` for a unit direction ``u_i`` over all the
    parameters: a single coordinate (``directions="dirac"``, the default: distinct
    coordinates, so the canaries do not interfere; needs ``count <= number of parameters``)
    or a random Gaussian direction (``"gaussian"``). It is included by a fair coin, and an
    included canary joins each step with probability ``sample_rate`` (independently), like a
    Poisson-sampled example. Its score is ``-<final - initial, u_i>`` (or relative to a
    reference run, see :meth:`scores`): SGD moves the parameters against the gradients it
    sums, so included canaries score higher. (With
    momentum or adaptive optimizers the movement is no longer a sum of steps, but it still
    correlates with the injected gradient.)

    Set ``norm`` to the clipping bound to audit the noise (a correct implementation clips a
    canary to the bound anyway), or far above it to test that clipping happens at all.

    Args:
      params: the initial parameters, a pytree of JAX arrays or torch tensors (kept, as a
        numpy copy, to measure the movement).
      count: number of canaries ``m``, >= 2.
      sample_rate: the Poisson sampling rate of the training run.
      seed: the auditor's seed: the coins, the directions and the per-step sampling follow
        from it. Keep it from the training code.
      norm: each canary gradient's norm, > 0.
      directions: ``"dirac"`` or ``"gaussian"``.
    """

    def __init__(
        self,
        params: Any,
        count: int,
        *,
        sample_rate: float,
        seed: int,
        norm: float = 1.0,
        directions: str = "dirac",
    ) -> None:
        fn = "GradientCanaries"
        super().__init__(fn, count, seed)
        self.sample_rate = check_sample_rate(fn, sample_rate)
        if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm > 0:
            raise PergradValueError(f"{fn}: norm must be a positive number, got {norm!r}.")
        self.norm = float(norm)
        if directions not in ("dirac", "gaussian"):
            raise PergradValueError(
                f"{fn}: directions must be 'dirac' or 'gaussian', got {directions!r}."
            )
        self.directions = directions
        self._initial = _FlatParams.of(fn, params)
        size = self._initial.size
        rng = _rng(self.seed, _DESIGN)
        if directions == "dirac":
            if self.count > size:
                raise PergradValueError(
                    f"{fn}: directions='dirac' needs count <= the number of parameters "
                    f"({size}), one coordinate per canary; got count={self.count}. Use "
                    "directions='gaussian' or fewer canaries."
                )
            self._coordinates = rng.choice(size, self.count, replace=False)
            self._unit = None
        else:
            unit = rng.standard_normal((self.count, size))
            self._unit = unit / np.linalg.norm(unit, axis=1, keepdims=True)
        self._included_ids = np.flatnonzero(self.included)

    def unit_directions(self, ids: np.ndarray) -> np.ndarray:
        """``(len(ids), P)`` float64: the unit directions of canaries ``ids``, flattened."""
        if self._unit is not None:
            return self._unit[ids]
        rows = np.zeros((len(ids), self._initial.size))
        rows[np.arange(len(ids)), self._coordinates[ids]] = 1.0
        return rows

    def sampled(self, step: int) -> np.ndarray:
        """The ids of the included canaries that step ``step`` samples (same ids every call)."""
        step = check_count("GradientCanaries.sampled", "step", step, minimum=0)
        joins = _rng(self.seed, _SAMPLING, step).random(self._included_ids.size)
        return self._included_ids[joins < self.sample_rate]

    def rows(self, step: int, pad_to: int | None = None) -> tuple[Any, Any]:
        """This step's canary gradients and their mask, in the parameters' framework.

        Returns ``(grads, mask)``: ``grads`` like the parameters with a leading axis of the
        number sampled (or ``pad_to``, with zero rows masked off, so ``jax.jit`` sees one
        shape; :func:`pergrad.dp.max_batch_size_for` ``(num_included, sample_rate)`` is a
        safe size), ``mask`` a boolean ``(rows,)`` array.
        """
        ids = self.sampled(step)
        size = ids.size if pad_to is None else pad_to
        if ids.size > size:
            raise PergradValueError(
                f"GradientCanaries.rows: step {step} samples {ids.size} canaries, more than "
                f"pad_to={pad_to}; pass a larger pad_to (truncating would change the sampling)."
            )
        flat = np.zeros((size, self._initial.size))
        flat[: ids.size] = self.norm * self.unit_directions(ids)
        mask = np.arange(size) < ids.size
        return self._initial.batch_like(flat), self._initial.array_like(mask)

    def inject(
        self, grads: Any, mask: Any, step: int, pad_to: int | None = None
    ) -> tuple[Any, Any]:
        """``grads`` and ``mask`` with this step's canary gradients appended as examples.

        Args:
          grads: per-example gradients, leaves ``(B, *param_shape)``, same pytree and
            framework as the parameters.
          mask: ``(B,)`` booleans (False for padding), or None (every row is real).
          step: the step number, 0, 1, 2, ...: each step samples the included canaries anew.
          pad_to: see :meth:`rows`.

        Returns:
          ``(grads, mask)`` with ``B + rows`` examples; feed both to the DP aggregate
          (``tx.update(grads, state, params, mask=mask)``, ``clipped_sum(grads, C, mask)``).
        """
        rows, rows_mask = self.rows(step, pad_to)
        return self._initial.append(grads, mask, rows, rows_mask)

    def scores(self, final_params: Any, reference: Any = None) -> np.ndarray:
        """``(count,)`` float64: each canary's score, ``-<final - start, u_i>``.

        ``start`` is the initial parameters, or ``reference``: the final parameters of a
        run *without* canaries from the same initial parameters, with its own, independent
        noise and batches. Subtracting it removes most of the movement the data causes
        along the canary directions (on a small model that movement hides the canaries; on
        digits' 2410-parameter MLP, 100 noise-free steps, it falls from 0.10 to 0.008 per
        coordinate against a canary signal of 0.04). The bound stays sound because the
        reference run is independent of the coins and of the audited run's randomness; it
        is NOT sound if the reference reuses the audited run's noise key or batches (the
        noise would cancel). It costs one more training run.
        """
        fn = "GradientCanaries.scores"
        final = _FlatParams.of(fn, final_params).values
        start = self._initial.values if reference is None else _FlatParams.of(fn, reference).values
        for name, values in (("final_params", final), ("reference", start)):
            if values.shape != self._initial.values.shape:
                raise PergradValueError(
                    f"{fn}: {name} must be the parameters the canaries were made for, "
                    f"{self._initial.size} numbers; got {values.size}."
                )
        moved = final - start
        if self._unit is not None:
            return -(self._unit @ moved)
        return -moved[self._coordinates]


class _FlatParams:
    """A parameter pytree as one flat float64 vector, and the way back to the framework."""

    def __init__(self, backend: Any, template: Any, treedef: Any, leaves: list[Any]) -> None:
        self.backend = backend
        self.template = template  # one leaf, for the framework and device
        self.treedef = treedef
        self.shapes = [tuple(backend.shape(leaf)) for leaf in leaves]
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.size = sum(self.sizes)
        copies = [np.asarray(backend.to_numpy(leaf)) for leaf in leaves]
        self.values = np.concatenate([copy.astype(np.float64).ravel() for copy in copies])
        self.dtypes = [copy.dtype for copy in copies]

    @classmethod
    def of(cls, fn: str, params: Any) -> _FlatParams:
        backend = backend_of(params, fn, "params")
        _, leaves, treedef = backend.flatten(params)
        if not leaves:
            raise PergradValueError(f"{fn}: params has no array leaves.")
        return cls(backend, leaves[0], treedef, leaves)

    def batch_like(self, flat: np.ndarray) -> Any:
        """``(n, P)`` numpy rows as a pytree of ``(n, *shape)`` framework arrays."""
        leaves, start = [], 0
        for shape, size, dtype in zip(self.shapes, self.sizes, self.dtypes):
            block = flat[:, start : start + size].reshape(len(flat), *shape).astype(dtype)
            leaves.append(self.backend.from_numpy(block, self.template))
            start += size
        return self.backend.unflatten(self.treedef, leaves)

    def array_like(self, values: np.ndarray) -> Any:
        return self.backend.from_numpy(values, self.template)

    def append(self, grads: Any, mask: Any, rows: Any, rows_mask: Any) -> tuple[Any, Any]:
        bk = self.backend
        _, leaves, treedef = bk.flatten(grads)
        _, row_leaves, _ = bk.flatten(rows)
        if len(leaves) != len(row_leaves) or any(
            tuple(bk.shape(g)[1:]) != shape for g, shape in zip(leaves, self.shapes)
        ):
            raise PergradValueError(
                "GradientCanaries.inject: grads must be per-example gradients of the "
                f"parameters the canaries were made for (leaf shapes {self.shapes} after the "
                f"batch axis); got leaf shapes {[tuple(bk.shape(g)) for g in leaves]}."
            )
        batch = bk.shape(leaves[0])[0]
        if mask is None:
            mask = np.ones(batch, bool)
        if not bk.is_array(mask) or isinstance(mask, np.ndarray):
            mask = bk.from_numpy(np.asarray(mask, bool), leaves[0])
        if tuple(bk.shape(mask)) != (batch,):
            raise PergradValueError(
                f"GradientCanaries.inject: mask must have shape ({batch},), one entry per "
                f"example of grads; got {tuple(bk.shape(mask))}."
            )
        joined = [bk.concatenate([g, r], 0) for g, r in zip(leaves, row_leaves)]
        return bk.unflatten(treedef, joined), bk.concatenate([mask, rows_mask], 0)


class InputCanaries(_Coins):
    """Black-box canaries: inputs with wrong labels, inserted into the training set.

    Example::

        canaries = InputCanaries(x_held_out[:500], y_held_out[:500], num_classes=10,
                                 seed=audit_seed)
        x_train2, y_train2 = canaries.insert(x_train, y_train)   # + the included canaries
        ... train on (x_train2, y_train2) with DP-SGD ...
        scores = -per_example_loss(final_model, canaries.inputs, canaries.labels)

    Canary ``i`` is ``inputs[i]`` with ``labels[i]``, a label drawn uniformly among the wrong
    ones from the seed. Included canaries are appended to the training set (Poisson sampling
    then treats them like any example); a model that memorises them fits their wrong labels,
    so the score is the negative loss of the wrong label (or the loss before training minus
    the loss after, which removes each canary's difficulty). The inputs should come from data
    that is not in the training set (a held-out split), so that excluded canaries are truly
    absent.

    Args:
      inputs: ``(count, ...)`` canary inputs (numpy, or anything ``np.asarray`` takes).
      true_labels: ``(count,)`` int labels of the inputs; the canaries get other labels.
      num_classes: the number of classes, >= 2.
      seed: the auditor's seed (coins and labels).
    """

    def __init__(self, inputs: Any, true_labels: Any, *, num_classes: int, seed: int) -> None:
        fn = "InputCanaries"
        inputs, true_labels = np.asarray(inputs), np.asarray(true_labels)
        if inputs.ndim < 1 or true_labels.shape != inputs.shape[:1]:
            raise PergradValueError(
                f"{fn}: true_labels must have shape (count,) with count = len(inputs); got "
                f"inputs {inputs.shape} and true_labels {true_labels.shape}."
            )
        if true_labels.dtype.kind not in "iu":
            raise PergradTypeError(
                f"{fn}: true_labels must be integer class ids, got dtype {true_labels.dtype}."
            )
        super().__init__(fn, len(inputs), seed)
        num_classes = check_count(fn, "num_classes", num_classes, minimum=2)
        if true_labels.min() < 0 or true_labels.max() >= num_classes:
            raise PergradValueError(
                f"{fn}: true_labels must be in [0, {num_classes}); got values from "
                f"{true_labels.min()} to {true_labels.max()}."
            )
        shift = _rng(self.seed, _DESIGN).integers(1, num_classes, self.count)
        self.inputs = inputs
        self.labels = ((true_labels + shift) % num_classes).astype(true_labels.dtype)

    def insert(self, x_train: Any, y_train: Any) -> tuple[np.ndarray, np.ndarray]:
        """The training set with the included canaries (wrong labels) appended, as numpy."""
        x_train, y_train = np.asarray(x_train), np.asarray(y_train)
        if x_train.shape[1:] != self.inputs.shape[1:] or y_train.shape != x_train.shape[:1]:
            raise PergradValueError(
                f"InputCanaries.insert: x_train must be (N, {', '.join(map(str, self.inputs.shape[1:]))}) "
                f"like the canary inputs and y_train (N,); got {x_train.shape} and "
                f"{y_train.shape}."
            )
        return (
            np.concatenate([x_train, self.inputs[self.included].astype(x_train.dtype)]),
            np.concatenate([y_train, self.labels[self.included].astype(y_train.dtype)]),
        )


@dataclass(frozen=True)
class AuditReport:
    """What :func:`audit` found.

    Attributes:
      epsilon: the accountant's epsilon for the run (the claim under test).
      epsilon_lower_bound: the lower bound from the canary scores (by ``method``).
      ceiling: the largest bound these canaries could give (every guess right, by the
        audit's ``method``); a claim above it cannot be refuted by this audit, however the
        training leaks.
      violated: ``epsilon_lower_bound > epsilon``: the implementation leaks more than it
        claims (wrong with probability at most ``significance`` if the claim is true).
      delta, significance: as passed.
      num_canaries, num_included: canaries made, and included by their coins.
      auroc: how well the scores separate included from excluded canaries (0.5: not at all).
      seconds: wall time of the training run and the statistics.
      in_scores, out_scores: the scores, split by coin.
    """

    epsilon: float
    epsilon_lower_bound: float
    ceiling: float
    violated: bool
    delta: float
    significance: float
    num_canaries: int
    num_included: int
    auroc: float
    seconds: float
    in_scores: np.ndarray
    out_scores: np.ndarray

    def __str__(self) -> str:
        verdict = "VIOLATED" if self.violated else "not refuted"
        return (
            f"claimed epsilon {self.epsilon:.3f} (delta {self.delta:g}); empirical lower bound "
            f"{self.epsilon_lower_bound:.3f} at significance {self.significance:g} "
            f"(ceiling {self.ceiling:.3f}, {self.num_canaries} canaries, "
            f"{self.num_included} included, AUROC {self.auroc:.3f}): {verdict}"
        )


def audit(
    train: Callable[[Any], Any],
    canaries: GradientCanaries | InputCanaries,
    *,
    noise_multiplier: float,
    sample_rate: float | None = None,
    steps: int | None = None,
    delta: float,
    significance: float = 0.05,
    accountant: str = "rdp",
    guesses: Any = None,
    noise: NoiseMechanism | None = None,
    method: str = "one-run",
) -> AuditReport:
    """Runs one DP training with canaries and compares the empirical bound with the claim.

    Example::

        canaries = GradientCanaries(params, count=1000, sample_rate=q, seed=audit_seed)

        def train(canaries):           # the user's DP-SGD loop, with the canaries injected
            ...
            return canaries.scores(final_params)

        report = audit(train, canaries, noise_multiplier=1.0, sample_rate=q, steps=T,
                       delta=1e-5)
        print(report)                  # claimed epsilon, lower bound, verdict

    ``train(canaries)`` must run the whole training with the canaries (injected gradients, or
    the training set from :meth:`InputCanaries.insert`) and return the ``(count,)`` scores in
    the canaries' order. The claim is the accountant's epsilon, :func:`pergrad.dp.epsilon`
    ``(noise_multiplier, sample_rate, steps, delta, accountant, noise=noise)``; the bound is
    :func:`pergrad.dp.epsilon_lower_bound` of the scores split by the coins (with
    ``guesses`` and ``method``). ``violated``
    means the bound exceeds the claim: the implementation is broken (or the claim's
    parameters are not those of the run), with confidence ``1 - significance``. Not violated
    means only that this attack found nothing: check ``ceiling`` (canaries enough to refute
    the claim at all?) and ``auroc``.

    **Correlated noise** (``noise=`` a mechanism made for one run, :func:`pergrad.dp.toeplitz`,
    :func:`pergrad.dp.blt`, :func:`pergrad.dp.optimal_blt`): ``steps`` (and ``sample_rate``, if
    any) come from it, and the claim is its accounting, one Gaussian release of
    ``noise_multiplier`` for the participation pattern it was made for. Gradient canaries must
    keep that pattern, or the claim would not cover them and a violation would prove nothing:
    the audit checks their realised steps against ``noise.participations`` and
    ``noise.min_separation`` and refuses canaries that take part more often or closer
    together. ``GradientCanaries(..., sample_rate=1.0)`` with a mechanism made for
    ``participations=steps`` puts each included canary in every step: the canary's signal then
    adds up in the final model as the noise of the prefix sums does, the strongest case for an
    audit of the final parameters. Since such a run is exactly one Gaussian release,
    ``method="f-dp"`` (the Gaussian trade-off curve, more power) fits it.

    Cost: one training run with the canaries (the injected gradients add about
    ``count / 2 * sample_rate`` rows to each batch), and well under a second of statistics.
    """
    if not isinstance(canaries, (GradientCanaries, InputCanaries)):
        raise PergradTypeError(
            f"audit: canaries must be GradientCanaries or InputCanaries, got "
            f"{type(canaries).__name__}."
        )
    if not callable(train):
        raise PergradTypeError(f"audit: train must be callable, got {type(train).__name__}.")
    if method not in ("one-run", "f-dp"):  # before the training run, not after it
        raise PergradValueError(f"audit: method must be 'one-run' or 'f-dp'; got {method!r}.")
    claimed = accountant_epsilon(
        noise_multiplier, sample_rate, steps, delta, accountant, noise=noise
    )
    if noise is not None and isinstance(canaries, GradientCanaries):
        _check_participation(canaries, noise)
    start = time.perf_counter()
    in_scores, out_scores = canaries.split(train(canaries))
    bound = epsilon_lower_bound(
        in_scores, out_scores, delta, significance, guesses=guesses, method=method
    )
    ceiling = _ceiling(canaries, delta, significance, guesses, method)
    return AuditReport(
        epsilon=claimed,
        epsilon_lower_bound=bound,
        ceiling=ceiling,
        violated=bound > claimed,
        delta=delta,
        significance=significance,
        num_canaries=canaries.count,
        num_included=canaries.num_included,
        auroc=auroc(in_scores, out_scores),
        seconds=time.perf_counter() - start,
        in_scores=in_scores,
        out_scores=out_scores,
    )


def _ceiling(
    canaries: GradientCanaries | InputCanaries,
    delta: float,
    significance: float,
    guesses: Any,
    method: str,
) -> float:
    """The largest bound the audit could give: :func:`epsilon_lower_bound_ceiling` for the
    one-run method; for ``"f-dp"``, the bound of these coins' split perfectly separated."""
    if method == "one-run":
        return epsilon_lower_bound_ceiling(canaries.count, delta, significance, guesses=guesses)
    included = canaries.num_included
    if included in (0, canaries.count):
        return 0.0  # the coins put every canary on one side: no guess can be checked
    return epsilon_lower_bound(
        np.ones(included),
        np.zeros(canaries.count - included),
        delta,
        significance,
        guesses=guesses,
        method=method,
    )


CANARY_PATTERN = (
    "audit: the gradient canaries take part in up to {most} steps of the run, {closest} apart "
    "at the closest (each joins each step with probability sample_rate={rate}), but "
    "noise={noise!r} is accounted for at most {participations} steps at least {separation} "
    "apart: its claim does not cover the canaries, and a bound above it would prove nothing. "
    "Give the canaries the mechanism's pattern, e.g. every step:\n\n"
    "    canaries = pergrad.dp.GradientCanaries(params, count, sample_rate=1.0, seed=seed)\n"
    "    noise = pergrad.dp.toeplitz(coefs, steps={steps}, participations={steps})"
)


def _check_participation(canaries: GradientCanaries, noise: NoiseMechanism) -> None:
    """Refuses gradient canaries whose realised steps break the participation pattern that
    ``noise`` is accounted for: at most ``participations`` steps, ``min_separation`` apart
    (None: 1), or, with a ``sample_rate`` and several groups, cyclic Poisson sampling, which
    canaries that join every step independently do not follow."""
    steps = noise.steps
    participations = getattr(noise, "participations", None)
    if steps is None or participations is None:  # accounted with sampling at every step
        return
    separation = getattr(noise, "min_separation", None) or 1
    if noise.sample_rate is not None:
        if separation > 1:
            raise PergradValueError(
                f"audit: noise={noise!r} is accounted for cyclic Poisson sampling over "
                f"{separation} groups, which GradientCanaries do not follow (each joins every "
                f"step with probability sample_rate={canaries.sample_rate}); audit a mechanism "
                "accounted without sampling, or with min_separation=1 (Poisson sampling at "
                "every step)."
            )
        return
    last = np.full(canaries.count, -np.inf)
    taken = np.zeros(canaries.count, np.int64)
    closest = math.inf
    for step in range(steps):
        ids = canaries.sampled(step)
        if ids.size:
            closest = min(closest, float((step - last[ids]).min()))
            last[ids] = step
            taken[ids] += 1
    if taken.max() > participations or closest < separation:
        raise PergradValueError(
            CANARY_PATTERN.format(
                most=int(taken.max()),
                closest="never twice" if math.isinf(closest) else f"{int(closest)} step(s)",
                rate=canaries.sample_rate,
                noise=noise,
                participations=participations,
                separation=separation,
                steps=steps,
            )
        )
