"""Inverse-Hessian-vector products: ``(H + damping I)^-1 v`` for many vectors ``v`` at once.

``H`` is the Hessian of the MEAN loss over a batch, as a function of the flat parameter vector
(see ``flat_params.py``). Everything is built on the backend's Hessian-vector product and works
on rows: ``k`` vectors are a ``(k, P)`` array, solved together.

Three solvers, each a small frozen dataclass of its options:

* :class:`Exact`: materialise ``H`` (``P`` Hessian-vector products, in blocks) and factorise
  ``H + damping I`` by Cholesky when it is positive definite well above rounding; otherwise
  (and for a grid of dampings, one eigendecomposition for all) invert the shifted eigenvalues,
  which also tells when ``H + damping I`` is singular or indefinite. For small models (``P`` up
  to a few thousand).
* :class:`CG`: conjugate gradient, one independent recursion per vector, run in lockstep.
  Needs ``H + damping I`` positive definite.
* :class:`LiSSA`: the stochastic Neumann series of Agarwal et al. (2017), as used by Koh &
  Liang (2017). Needs every eigenvalue of ``H + damping I`` in ``(0, 2 * scale)``.

Two more, :class:`KFAC` and :class:`EKFAC`, replace ``H`` by a layer-wise Kronecker-factored
curvature built from the capture engine's records; their options live here with the others,
their algorithm in ``kfac.py``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pergrad._src.backends import Backend
from pergrad._src.errors import PergradTypeError, PergradValueError


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
class Exact:
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


@dataclass(frozen=True)
class CG:
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


@dataclass(frozen=True)
class LiSSA:
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


def _check_dense_limit(owner: str, dense_limit: Any) -> None:
    ok = _is_int(dense_limit) and dense_limit >= 0
    _require(ok, owner, "dense_limit must be an int >= 0", dense_limit)


@dataclass(frozen=True)
class KFAC:
    """Kronecker-factored curvature (K-FAC: Martens & Grosse 2015; convolutions: Grosse &
    Martens 2016), inverted through two small eigendecompositions per layer.

    Each weight of a dense layer (``nn.Linear``, Hugging Face's ``Conv1D``, a JAX ``x @ W``
    or ``W @ x``) or convolution (PyTorch ``nn.Conv1d`` / ``nn.Conv2d``, ``groups=1``) gets the
    block ``A (x) S``, from one pass over the Hessian batch: ``A`` the mean over examples and
    positions of ``a a^T`` (``a``: the layer's input at a position, a conv patch), ``S`` the
    mean over examples of ``sum_t g_t g_t^T`` (``g_t``: the gradient of ``fn`` at the layer's
    output). ``(A (x) S + damping I)^-1`` costs a ``p x p`` and a ``q x q`` eigendecomposition
    per ``q x p`` weight, shared by every damping of a grid. Every other parameter (biases,
    norms' scales, embeddings, bare parameters, JAX convolutions) gets a block of its own: the
    exact one (the mean of ``g g^T`` of its per-example gradients, eigendecomposed) when it has
    at most ``dense_limit`` numbers, else the diagonal (the mean of ``g^2``). Blocks do not
    interact: a weight and its bias are two blocks.

    The curvature is the empirical Fisher of the Hessian batch (``g`` from ``fn`` at each
    example's own labels), see :func:`pergrad.influence.influence_function`.

    Args:
      dense_limit: the largest parameter (number of entries) that gets an exact block rather
        than a diagonal when no layer factors it; its block costs ``dense_limit^2`` memory.
    """

    dense_limit: int = 2048

    def __post_init__(self) -> None:
        _check_dense_limit("KFAC", self.dense_limit)


@dataclass(frozen=True)
class EKFAC:
    """Eigenvalue-corrected K-FAC (George et al. 2018), as Kronfluence uses it (Grosse et al.
    2023): K-FAC's eigenbasis, with each Kronecker eigenvalue replaced by the mean squared
    per-example gradient in that basis, ``mean_i (Q_S^T G_i Q_A)^2``.

    The corrected eigenvalues are the exact diagonal of the empirical Fisher in K-FAC's
    eigenbasis, so EK-FAC is never further from it than K-FAC (in Frobenius norm). Cost: one
    more pass over the Hessian batch than :class:`KFAC`, forming each example's gradient in
    the rotated basis (``q x p`` per example and layer, ``chunk_size`` examples at a time; for
    a layer applied at one position, never formed).

    Args:
      dense_limit: as for :class:`KFAC`.
    """

    dense_limit: int = 2048

    def __post_init__(self) -> None:
        _check_dense_limit("EKFAC", self.dense_limit)


Solver = Exact | CG | LiSSA | KFAC | EKFAC
# Solvers that replace the Hessian by a factored curvature (influence/kfac.py), not HVPs.
CURVATURE_SOLVERS = (KFAC, EKFAC)
_BY_NAME: dict[str, Callable[[], Solver]] = {
    "exact": Exact,
    "cg": CG,
    "lissa": LiSSA,
    "kfac": KFAC,
    "ekfac": EKFAC,
}


def check_solver(func_name: str, solver: Any) -> Solver:
    """``solver`` as a solver object: a name (default options) or an instance."""
    if isinstance(solver, (Exact, CG, LiSSA, KFAC, EKFAC)):
        return solver
    if isinstance(solver, str) and solver.lower() in _BY_NAME:
        return _BY_NAME[solver.lower()]()
    kind = PergradValueError if isinstance(solver, str) else PergradTypeError
    raise kind(
        f"{func_name}: solver must be one of {list(_BY_NAME)} or an instance of "
        f"pergrad.influence.Exact / CG / LiSSA / KFAC / EKFAC (to set its options); got "
        f"{solver!r}."
    )


def check_damping(func_name: str, damping: Any) -> float:
    if not (_is_number(damping) and damping >= 0):
        raise PergradValueError(
            f"{func_name}: damping must be a finite number >= 0 (added to the Hessian's "
            f"diagonal); got {damping!r}."
        )
    return float(damping)


@dataclass
class HessianOperator:
    """``rows -> rows @ (H + damping I)`` for the mean loss over a batch, ``rows`` ``(k, P)``.

    Attributes:
      backend: the framework.
      hvp: the backend's Hessian-vector product of ``mean_loss(vector, batch)``.
      vector: ``(P,)`` the parameters at which the Hessian is taken.
      batch: the tuple of batched arguments the mean loss runs over.
      batch_size: the number of examples in ``batch``.
      damping: added to the diagonal.
    """

    backend: Backend
    hvp: Callable[..., Any]
    vector: Any
    batch: tuple[Any, ...]
    batch_size: int
    damping: float

    @classmethod
    def create(
        cls,
        bk: Backend,
        example_loss: Callable[[Any, tuple[Any, ...]], Any],
        vector: Any,
        batch: tuple[Any, ...],
        batch_size: int,
        damping: float,
        chunk_size: int | None,
    ) -> HessianOperator:
        """``example_loss(vector, example)`` is the loss of one example (a tuple of its
        arguments) as a function of the flat parameters."""
        per_example = bk.vmap(example_loss, (None, 0), chunk_size, None)

        def mean_loss(flat: Any, examples: tuple[Any, ...]) -> Any:
            return per_example(flat, examples).mean()

        return cls(bk, bk.hvp(mean_loss), vector, batch, batch_size, damping)

    @property
    def size(self) -> int:
        return self.backend.shape(self.vector)[0]

    def __call__(self, rows: Any, batch: tuple[Any, ...] | None = None) -> Any:
        product = self.hvp(self.vector, rows, self.batch if batch is None else batch)
        return product + self.damping * rows if self.damping else product

    def sample(self, rng: np.random.Generator, size: int) -> tuple[Any, ...]:
        """``size`` examples of the batch drawn without replacement (all, if fewer)."""
        bk = self.backend
        chosen = np.sort(rng.choice(self.batch_size, min(size, self.batch_size), replace=False))
        index = bk.from_numpy(chosen, self.vector)
        _, leaves, treedef = bk.flatten(self.batch)
        return bk.unflatten(treedef, [leaf[index] for leaf in leaves])


def solve(func_name: str, operator: HessianOperator, rows: Any, solver: Solver) -> Any:
    """``(k, P)`` rows ``x_j = (H + damping I)^-1 rows[j]``."""
    if isinstance(solver, Exact):
        return _exact(func_name, operator, rows, solver)
    if isinstance(solver, CG):
        return _cg(func_name, operator, rows, solver)
    return _lissa(func_name, operator, rows, solver)


def solve_grid(
    func_name: str, operator: HessianOperator, rows: Any, solver: Solver, dampings: list[float]
) -> list[Any]:
    """``solve`` for each damping of a grid: the exact solver shares one Hessian and one
    eigendecomposition; the iterative ones run once per damping."""
    if len(dampings) == 1:
        return [solve(func_name, dataclasses.replace(operator, damping=dampings[0]), rows, solver)]
    if isinstance(solver, Exact):
        return exact_solutions(
            func_name, operator, rows, hessian_matrix(operator, solver), dampings
        )
    return [
        solve(func_name, dataclasses.replace(operator, damping=d), rows, solver) for d in dampings
    ]


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


def _exact(func_name: str, operator: HessianOperator, rows: Any, solver: Exact) -> Any:
    """One damping: a Cholesky factorisation of ``H + damping I`` when it is positive definite
    well above rounding (about 1/20 of an eigendecomposition's cost); otherwise the
    eigendecomposition, which diagnoses a singular or indefinite system."""
    bk = operator.backend
    hessian = hessian_matrix(operator, solver)
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
        warnings.warn(
            f"{func_name}: H + damping*I has {int(negative.sum())} negative eigenvalue(s) "
            f"(smallest {shifted.min():.3g}): the parameters are not at a minimum of the "
            f"training loss, where influence functions are derived. Scores use the indefinite "
            f"inverse; pass damping > {damping - shifted.min():.3g} to make it positive "
            f"definite, e.g. damping={suggested:.2g}.",
            InfluenceWarning,
            stacklevel=5,
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
        warnings.warn(
            f"{func_name}: CG met negative curvature for {int(negative.sum())} of {count} "
            f"vector(s): H + damping*I is not positive definite (the parameters are not at a "
            f"minimum). Their solutions stopped early; pass a larger damping.",
            InfluenceWarning,
            stacklevel=5,
        )
    if active.any():
        relative = np.sqrt(squared[active]) / (target[active] / solver.tol)
        warnings.warn(
            f"{func_name}: CG did not converge within max_iter={solver.max_iter} iterations "
            f"for {int(active.sum())} of {count} vector(s) (largest relative residual "
            f"{relative.max():.3g}, tol={solver.tol:g}). Pass CG(max_iter=...) larger, a "
            f"looser tol, or damping > 0 (a better-conditioned system converges faster).",
            InfluenceWarning,
            stacklevel=5,
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
        warnings.warn(
            f"{func_name}: LiSSA has not converged after depth={solver.depth} steps (estimated "
            f"relative error {worst:.2g}). Its error shrinks like (1 - (lambda_min + damping) / "
            f"scale)^depth: pass a larger LiSSA(depth=...), or damping > 0.",
            InfluenceWarning,
            stacklevel=5,
        )
