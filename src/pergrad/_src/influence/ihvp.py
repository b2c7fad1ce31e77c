"""Inverse-Hessian-vector products: ``(H + damping I)^-1 v`` for many vectors ``v`` at once.

``H`` is the Hessian of the MEAN loss over a batch, as a function of the flat parameter vector
(see ``flat_loss.py``). Everything is built on the backend's Hessian-vector product and works
on rows: ``k`` vectors are a ``(k, P)`` array, solved together.

Three solvers (``protocol.py``'s :class:`Solver`), each a small frozen dataclass of its options:

* :class:`Exact`: materialise ``H`` (``P`` Hessian-vector products, in blocks) and factorise
  ``H + damping I`` by Cholesky when it is positive definite well above rounding; otherwise
  (and for a grid of dampings, one eigendecomposition for all) invert the shifted eigenvalues,
  which also tells when ``H + damping I`` is singular or indefinite. For small models (``P`` up
  to a few thousand).
* :class:`CG`: conjugate gradient, one independent recursion per vector, run in lockstep.
  Needs ``H + damping I`` positive definite.
* :class:`LiSSA`: the stochastic Neumann series of Agarwal et al. (2017), as used by Koh &
  Liang (2017). Needs every eigenvalue of ``H + damping I`` in ``(0, 2 * scale)``.

``kfac.py`` holds two more, :class:`KFAC` and :class:`EKFAC`, which replace ``H`` by a
layer-wise Kronecker-factored curvature built from the capture engine's records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pergrad._src.backends import Backend
from pergrad._src.errors import PergradValueError, warn_from_caller
from pergrad._src.influence.flat_loss import FlatLoss, HessianOperator
from pergrad._src.influence.protocol import Solver


class InfluenceWarning(UserWarning):
    """A numerical caveat of an influence computation: an iterative solver that did not
    converge, or a Hessian that is not positive definite."""


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _require(ok: bool, owner: str, message: str, value: Any) -> None:
    if not ok:
        raise PergradValueError(f"{owner}: {message}; got {value!r}.")


@dataclass(frozen=True)
class Exact(Solver, name="exact"):
    """Solve with the materialised Hessian and its eigendecomposition.

    Args:
      block_size: how many Hessian rows (Hessian-vector products) to compute at once; bounds
        memory at ``block_size`` times that of one Hessian-vector product.

    Cost: ``P`` Hessian-vector products, ``P x P`` memory, and one Cholesky factorisation
    (``P^3 / 3``) when ``H + damping I`` is positive definite, else one eigendecomposition
    (several times that), which a grid of dampings shares.
    """

    block_size: int = 256

    def __post_init__(self) -> None:
        ok = _is_int(self.block_size) and self.block_size > 0
        _require(ok, "Exact", "block_size must be a positive int", self.block_size)

    def prepare(
        self, caller: str, loss: FlatLoss, batch: tuple, count: int
    ) -> tuple[HessianOperator, Any]:
        """The operator and the materialised ``P x P`` Hessian (no damping)."""
        operator = loss.hessian(batch, count, 0.0)
        return operator, hessian_matrix(operator, self)

    def solve(
        self, caller: str, prepared: tuple[HessianOperator, Any], rows: Any, dampings: list
    ) -> list[Any]:
        """One damping: Cholesky (or the eigendecomposition, if it must); a grid: one
        eigendecomposition for all."""
        operator, hessian = prepared
        if len(dampings) == 1:
            return [_exact(caller, operator.with_damping(dampings[0]), rows, hessian)]
        return exact_solutions(caller, operator, rows, hessian, dampings)


@dataclass(frozen=True)
class CG(Solver, name="cg"):
    """Conjugate gradient on ``(H + damping I) x = v``, for every vector at once.

    Args:
      tol: stop a vector's recursion when its residual norm is below ``tol * |v|``. The
        default, 1e-3, was chosen on ``benchmarks/attribution_lds.py``'s MLP (9610
        parameters, 1000 examples): the LDS of its scores is the same to three decimals from
        1e-6 to 1e-2 and drops at 1e-1, and a solve at 1e-3 takes about half the time of
        1e-6 (the former default). Pass a smaller ``tol`` for scores accurate to more digits.
      max_iter: most iterations (each one Hessian-vector product per vector). In exact
        arithmetic CG converges in at most ``P`` iterations; an ill-conditioned ``H`` needs
        damping or more iterations. Vectors still above ``tol`` after ``max_iter`` give an
        :class:`InfluenceWarning`, as does negative curvature (``H + damping I`` not positive
        definite: add damping).
    """

    tol: float = 1e-3
    max_iter: int = 1000

    def __post_init__(self) -> None:
        _require(
            _is_number(self.tol) and self.tol > 0, "CG", "tol must be a positive number", self.tol
        )
        ok = _is_int(self.max_iter) and self.max_iter > 0
        _require(ok, "CG", "max_iter must be a positive int", self.max_iter)

    def prepare(self, caller: str, loss: FlatLoss, batch: tuple, count: int) -> HessianOperator:
        return loss.hessian(batch, count, 0.0)

    def solve(self, caller: str, prepared: HessianOperator, rows: Any, dampings: list) -> list[Any]:
        """One recursion per damping."""
        return [_cg(caller, prepared.with_damping(d), rows, self) for d in dampings]


@dataclass(frozen=True)
class LiSSA(Solver, name="lissa"):
    """The LiSSA recursion ``h <- v + (I - (H + damping I) / scale) h``; the answer is
    ``h / scale``.

    It is the Neumann series of ``((H + damping I) / scale)^-1``, so it converges only when
    every eigenvalue of ``H + damping I`` lies in ``(0, 2 * scale)``: ``scale`` must exceed the
    largest eigenvalue of the Hessian (keep them below ``scale``), and the Hessian must be
    positive definite. The error shrinks like ``(1 - (lambda_min + damping) / scale)^depth``, so
    ``damping > 0`` both rescues an indefinite or singular Hessian and speeds convergence, at
    the price of a bias towards smaller scores.

    Args:
      scale: above the largest eigenvalue of ``H + damping I``. None (default) estimates it
        with 20 power iterations on the Hessian batch and uses 1.25 times the estimate.
      depth: recursion steps, each one Hessian-vector product per vector.
      repeats: independent recursions averaged (useful with ``batch_size``: each draws its own
        minibatches).
      batch_size: None (default) uses the whole Hessian batch at every step (deterministic); an
        int draws that many examples at random per step (the stochastic LiSSA, cheaper steps,
        noisier answer).
      seed: seeds the minibatch draws and the power iteration.

    A recursion that grows faster than the series allows raises an error naming ``scale``; a
    deterministic one still moving after ``depth`` steps gives an :class:`InfluenceWarning`.
    """

    scale: float | None = None
    depth: int = 1000
    repeats: int = 1
    batch_size: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        ok = self.scale is None or (_is_number(self.scale) and self.scale > 0)
        _require(ok, "LiSSA", "scale must be a positive number or None (estimated)", self.scale)
        for name in ("depth", "repeats"):
            value = getattr(self, name)
            _require(_is_int(value) and value > 0, "LiSSA", f"{name} must be a positive int", value)
        ok = self.batch_size is None or (_is_int(self.batch_size) and self.batch_size > 0)
        _require(ok, "LiSSA", "batch_size must be a positive int or None", self.batch_size)
        _require(_is_int(self.seed), "LiSSA", "seed must be an int", self.seed)

    def prepare(self, caller: str, loss: FlatLoss, batch: tuple, count: int) -> HessianOperator:
        return loss.hessian(batch, count, 0.0)

    def solve(self, caller: str, prepared: HessianOperator, rows: Any, dampings: list) -> list[Any]:
        """One series per damping (its scale estimated for that damping when None)."""
        return [_lissa(caller, prepared.with_damping(d), rows, self) for d in dampings]


def check_damping(func_name: str, damping: Any) -> float:
    if not (_is_number(damping) and damping >= 0):
        raise PergradValueError(
            f"{func_name}: damping must be a finite number >= 0 (added to the Hessian's "
            f"diagonal); got {damping!r}."
        )
    return float(damping)


def check_dampings(func_name: str, damping: Any) -> list[float] | None:
    """A grid of dampings (a list or tuple of them, non-empty) checked, or None for one."""
    if not isinstance(damping, (list, tuple)):
        return None
    if not damping:
        raise PergradValueError(
            f"{func_name}: damping must be a number >= 0 or a non-empty list of them; got an "
            f"empty {type(damping).__name__}."
        )
    return [check_damping(func_name, d) for d in damping]


def as_backend_array(bk: Backend, values: np.ndarray, like: Any) -> Any:
    """numpy ``values`` as an array of ``like``'s framework, dtype and device."""
    return bk.from_numpy(np.asarray(values, dtype=np.dtype(bk.dtype_name(like))), like)


def _row_norms(bk: Backend, rows: Any) -> np.ndarray:
    return np.sqrt(bk.to_numpy((rows * rows).sum(1)).astype(np.float64))


def hessian_matrix(operator: HessianOperator, solver: Exact) -> Any:
    """The ``P x P`` Hessian (no damping), from ``P`` Hessian-vector products in blocks,
    symmetrised."""
    bk, size = operator.backend, operator.size
    identity = bk.eye(size, operator.vector)
    blocks = [
        operator.hvp(operator.vector, identity[start : start + solver.block_size], operator.batch)
        for start in range(0, size, solver.block_size)
    ]
    hessian = bk.concatenate(blocks, axis=0)
    return (hessian + hessian.T) * 0.5


def _exact(func_name: str, operator: HessianOperator, rows: Any, hessian: Any) -> Any:
    """One damping, ``operator.damping``: a Cholesky factorisation of ``H + damping I`` when it
    is positive definite well above rounding (about 1/20 of an eigendecomposition's cost);
    otherwise the eigendecomposition, which diagnoses a singular or indefinite system."""
    bk = operator.backend
    system = hessian + operator.damping * bk.eye(operator.size, hessian)
    factor = bk.cholesky(system)
    if factor is not None and _well_above_rounding(bk, system, factor, bk.dtype_name(rows)):
        return bk.cholesky_solve(factor, rows)
    return exact_solutions(func_name, operator, rows, hessian, [operator.damping])[0]


def exact_solutions(
    func_name: str, operator: HessianOperator, rows: Any, hessian: Any, dampings: list[float]
) -> list[Any]:
    """``(H + d I)^-1 rows`` for each damping ``d`` from ONE eigendecomposition of ``H``, each
    system's spectrum checked (a singular one refused, an indefinite one warned about)."""
    bk = operator.backend
    eigenvalues, eigenvectors = bk.eigh(hessian)
    projected = rows @ eigenvectors
    solutions = []
    for damping in dampings:
        shifted = eigenvalues + damping
        _check_spectrum(
            func_name, bk.to_numpy(shifted).astype(np.float64), bk.dtype_name(rows), damping
        )
        solutions.append((projected / shifted) @ eigenvectors.T)
    return solutions


def _well_above_rounding(bk: Backend, system: Any, factor: Any, dtype_name: str) -> bool:
    """Whether the smallest eigenvalue of a positive-definite ``system`` (factored) stands
    clear of the rounding of its largest: both estimated by 30 steps of (inverse) power
    iteration, with a factor of 10 of margin for the estimates."""
    size = bk.shape(system)[0]
    start = np.random.default_rng(0).standard_normal((1, size))
    vector = as_backend_array(bk, start / np.linalg.norm(start), system)
    largest = smallest_inverse = 0.0
    up, down = vector, vector
    for _ in range(30):
        up = up @ system
        largest = float(_row_norms(bk, up)[0])
        down = bk.cholesky_solve(factor, down)
        smallest_inverse = float(_row_norms(bk, down)[0])
        if not (largest > 0 and np.isfinite(smallest_inverse) and smallest_inverse > 0):
            return False
        up, down = up / largest, down / smallest_inverse
    resolution = size * np.finfo(np.dtype(dtype_name)).eps * largest
    return 1.0 / smallest_inverse > 10 * resolution


def _check_spectrum(func_name: str, shifted: np.ndarray, dtype_name: str, damping: float) -> None:
    """Refuse a singular ``H + damping I``; warn about an indefinite one.

    An eigenvalue is zero "to precision" when it is within ``P eps |lambda_max|`` of zero, the
    rounding of the computed Hessian's spectrum. A suggested damping always exceeds the one
    passed: it moves the smallest eigenvalue to a thousandth of the largest."""
    largest = float(np.abs(shifted).max())
    resolution = len(shifted) * np.finfo(np.dtype(dtype_name)).eps * largest
    suggested = damping - float(shifted.min()) + max(1e-3 * largest, 1e-8)
    zero = np.abs(shifted) <= resolution
    negative = shifted < -resolution
    if zero.any():
        indefinite = (
            f" and {int(negative.sum())} clearly negative (the parameters are not at a minimum)"
            if negative.any()
            else ""
        )
        raise PergradValueError(
            f"{func_name}: H + damping*I is singular (eigenvalues from {shifted.min():.3g} to "
            f"{shifted.max():.3g}; {int(zero.sum())} of them are zero to {dtype_name} "
            f"precision{indefinite}), so its inverse does not exist. This happens when the "
            f"model has more parameters than the Hessian batch pins down; pass "
            f"{'damping > 0' if damping == 0 else 'a larger damping'}, e.g. "
            f"damping={suggested:.2g}."
        )
    if negative.any():
        warn_from_caller(
            f"{func_name}: H + damping*I has {int(negative.sum())} negative eigenvalue(s) "
            f"(smallest {shifted.min():.3g}): the parameters are not at a minimum of the "
            f"training loss, where influence functions are derived. Scores use the indefinite "
            f"inverse; pass damping > {damping - shifted.min():.3g} to make it positive "
            f"definite, e.g. damping={suggested:.2g}.",
            InfluenceWarning,
        )


def _cg(func_name: str, operator: HessianOperator, rows: Any, solver: CG) -> Any:
    """Conjugate gradient on every row at once; each row keeps its own step sizes."""
    bk = operator.backend
    solution, residual = rows * 0.0, rows
    direction = residual
    squared = _row_norms(bk, residual) ** 2
    target = solver.tol * np.sqrt(squared)
    active = np.sqrt(squared) > target
    negative = np.zeros_like(active)
    for _ in range(solver.max_iter):
        if not active.any():
            break
        product = operator(direction)
        curvature = bk.to_numpy((direction * product).sum(1)).astype(np.float64)
        negative |= active & (curvature <= 0)
        active &= curvature > 0
        step = np.where(active, squared / np.where(active, curvature, 1.0), 0.0)
        step_rows = as_backend_array(bk, step[:, None], rows)
        solution = solution + step_rows * direction
        residual = residual - step_rows * product
        new_squared = _row_norms(bk, residual) ** 2
        active &= np.sqrt(new_squared) > target
        ratio = np.where(active, new_squared / np.where(squared > 0, squared, 1.0), 0.0)
        direction = residual + as_backend_array(bk, ratio[:, None], rows) * direction
        squared = new_squared
    _warn_cg(func_name, solver, active, negative, squared, target)
    return solution


def _warn_cg(
    func_name: str,
    solver: CG,
    active: np.ndarray,
    negative: np.ndarray,
    squared: np.ndarray,
    target: np.ndarray,
) -> None:
    count = len(active)
    if negative.any():
        warn_from_caller(
            f"{func_name}: CG met negative curvature for {int(negative.sum())} of {count} "
            f"vector(s): H + damping*I is not positive definite (the parameters are not at a "
            f"minimum). Their solutions stopped early; pass a larger damping.",
            InfluenceWarning,
        )
    if active.any():
        relative = np.sqrt(squared[active]) / (target[active] / solver.tol)
        warn_from_caller(
            f"{func_name}: CG did not converge within max_iter={solver.max_iter} iterations "
            f"for {int(active.sum())} of {count} vector(s) (largest relative residual "
            f"{relative.max():.3g}, tol={solver.tol:g}). Pass CG(max_iter=...) larger, a "
            f"looser tol, or damping > 0 (a better-conditioned system converges faster).",
            InfluenceWarning,
        )


def estimate_scale(operator: HessianOperator, seed: int, iterations: int = 20) -> float:
    """1.25 x the largest |eigenvalue| of ``H + damping I``, by power iteration."""
    bk = operator.backend
    start = np.random.default_rng(seed).standard_normal((1, operator.size))
    vector = as_backend_array(bk, start / np.linalg.norm(start), operator.vector)
    estimate = 0.0
    for _ in range(iterations):
        product = operator(vector)
        estimate = float(_row_norms(bk, product)[0])
        if not estimate > 0:
            break
        vector = product / estimate
    return 1.25 * estimate if estimate > 0 else 1.0


def _lissa(func_name: str, operator: HessianOperator, rows: Any, solver: LiSSA) -> Any:
    bk = operator.backend
    scale = solver.scale if solver.scale is not None else estimate_scale(operator, solver.seed)
    rng = np.random.default_rng(solver.seed)
    rhs_norms = _row_norms(bk, rows)
    total = None
    for _ in range(solver.repeats):
        estimate, recent = rows, [rows]
        for step in range(1, solver.depth + 1):
            batch = None if solver.batch_size is None else operator.sample(rng, solver.batch_size)
            estimate = rows + estimate - operator(estimate, batch) / scale
            recent = [*recent[-2:], estimate]
            if step % 50 == 0 or step == solver.depth:
                _check_lissa_growth(func_name, bk, estimate, rhs_norms, step, scale)
        if solver.batch_size is None:
            _warn_lissa(func_name, bk, recent, solver)
        total = estimate if total is None else total + estimate
    return total / (scale * solver.repeats)


def _check_lissa_growth(
    func_name: str, bk: Backend, estimate: Any, rhs_norms: np.ndarray, step: int, scale: float
) -> None:
    """The partial sums of a convergent series grow at most linearly: ``|h_t| <= (t+1)|v|``."""
    norms = _row_norms(bk, estimate)
    if np.all(np.isfinite(norms)) and np.all(norms <= 2 * (step + 1) * rhs_norms + 1e-30):
        return
    raise PergradValueError(
        f"{func_name}: LiSSA diverged after {step} steps (scale={scale:.4g}). The recursion "
        f"converges only when every eigenvalue of H + damping*I lies between 0 and "
        f"2*scale: pass LiSSA(scale=...) above the Hessian's largest eigenvalue (or "
        f"scale=None to estimate it), and damping > 0 if the Hessian has negative "
        f"eigenvalues (the parameters are not at a minimum)."
    )


def _warn_lissa(func_name: str, bk: Backend, recent: list[Any], solver: LiSSA) -> None:
    """Warn when the deterministic recursion is still moving: the remaining error of a
    geometric series with ratio r after a step s is about s * r / (1 - r)."""
    if len(recent) < 3:
        return
    last = _row_norms(bk, recent[2] - recent[1])
    before = _row_norms(bk, recent[1] - recent[0])
    size = np.maximum(_row_norms(bk, recent[2]), 1e-30)
    ratio = np.where(before > 0, last / np.where(before > 0, before, 1.0), 0.0)
    remaining = np.where(ratio < 1, last * ratio / np.maximum(1 - ratio, 1e-12), np.inf)
    # Steps at rounding level carry no information about the rate: converged.
    rounding = 100 * np.finfo(np.dtype(bk.dtype_name(recent[2]))).eps
    remaining = np.where(last <= rounding * size, 0.0, remaining)
    worst = float((remaining / size).max())
    if worst > 1e-3:
        warn_from_caller(
            f"{func_name}: LiSSA has not converged after depth={solver.depth} steps (estimated "
            f"relative error {worst:.2g}). Its error shrinks like (1 - (lambda_min + damping) / "
            f"scale)^depth: pass a larger LiSSA(depth=...), or damping > 0.",
            InfluenceWarning,
        )
