"""The two interfaces attribution is built from: solvers and estimators.

Each is a base class whose subclasses register themselves under a name (``class CG(Solver,
name="cg")``), so a name and an object with options are the same thing to every function that
takes one: ``solver="cg"`` is ``solver=CG()``, ``method="dot"`` is ``method=GradDot()``. The code
that uses a solver or an estimator calls its methods; it never asks which class it is. A new one
is one class in one file; importing that file registers it. The built-in ones register when the
package is imported (``__init__.py``).

**Solver** (``ihvp.py``: ``Exact``, ``CG``, ``LiSSA``; ``kfac.py``: ``KFAC``, ``EKFAC``): applies
``(H + d I)^-1`` to rows ``(k, P)`` of vectors over the flat parameters, ``H`` the Hessian of the
mean loss over a batch (plus a regulariser's), for each damping ``d`` of a list. A new solver is
a frozen dataclass of its options (each with a default: a name makes it with no arguments) that
subclasses :class:`Solver` with ``name=`` and implements ``prepare(caller, loss, batch, count)``,
the work that does not depend on the vectors (materialise the Hessian, factor a curvature), and
``solve(caller, prepared, rows, dampings)``, a list with ``(H + d I)^-1 rows`` for each damping,
``prepared`` being what ``prepare`` returned. ``loss`` is a :class:`FlatLoss`:
``loss.hessian(batch, count, d)`` is the Hessian-vector product on rows, ``loss.grads(batch)``
the per-example gradients ``(count, P)``; ``caller`` is the public function, to name in errors.
It then serves :func:`pergrad.influence.influence_function`, ``self_influence``, ``inverse_hvp``
and ``top_k``::

    @dataclass(frozen=True)
    class Fisher(Solver, name="diagonal_fisher"):   # diagonal of the empirical Fisher
        def prepare(self, caller, loss, batch, count):
            grads = loss.grads(batch)                  # (count, P)
            return (grads * grads).mean(0)             # (P,)

        def solve(self, caller, prepared, rows, dampings):
            return [rows / (prepared + d) for d in dampings]

    influence_function(loss, params, train, test, damping=1e-3, solver="diagonal_fisher")

**Estimator** (``influence_function.py``: ``"influence"``; ``similarity.py``: ``"dot"``,
``"cosine"``; ``tracin.py``: ``"tracin"``; ``trak.py``: ``"trak"``): scores training examples
against test examples, ``(n_train, n_test)``, positive meaning the training example helps. A new
estimator is a frozen dataclass of its options (each with a default) that subclasses
:class:`Estimator` with ``name=`` and implements ``prepare(task, test_batch)``: everything that
does not depend on the training examples (the test side's gradients, an inverse-Hessian
product), returning ``score(train_batch, count) -> (count, n_test)`` for one checked batch of
training examples. :func:`pergrad.influence.top_k` then streams a training set through it, and
``scores(task, train_batch, test_batch)`` (the whole matrix) comes with the base class. An
estimator that needs the whole training set at once (TRAK's kernel) implements ``scores``
instead, and ``top_k`` refuses it. ``self_scores(task, train_batch) -> (n_train,)``, each
example against itself, is optional. ``task`` is a :class:`Task`: the function of one example,
the parameters (for estimators over several models, a list of them), the test side's function
and the chunk size; ``task.loss()`` gives the per-example gradients::

    @dataclass(frozen=True)
    class Sign(Estimator, name="sign_agreement"):   # gradients' signs agreeing, in [-1, 1]
        def prepare(self, task, test_batch):
            loss = task.loss()
            test, _ = loss.check_batch("test_batch", test_batch)
            signs = loss.target(task.target_fn).grads(test).sign()      # (n_test, P)
            return lambda batch, count: loss.map_grads(
                batch, count, lambda grads: grads.sign() @ signs.T / signs.shape[1])

    top_k(loss, params, train_loader, (X_test, Y_test), k=10, method="sign_agreement")
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pergrad._src.backends import Backend, backend_of
from pergrad._src.errors import PergradTypeError, PergradValueError
from pergrad._src.influence.flat_loss import FlatLoss, check_batch, check_same_arity

# score(train_batch, count) -> (count, n_test): what Estimator.prepare returns.
Scorer = Callable[[tuple, int], Any]


def _register(registry: dict[str, type], kind: str, name: Any, cls: type) -> None:
    """``registry[name] = cls``, refusing a name that another class already holds (the same
    class defined again, e.g. a re-run notebook cell, replaces itself)."""
    if not (isinstance(name, str) and name and name == name.strip().lower()):
        raise PergradValueError(
            f"{cls.__qualname__}: a {kind}'s name must be a non-empty lower-case str (it is "
            f"looked up case-insensitively), e.g. class {cls.__name__}({kind.capitalize()}, "
            f"name={cls.__name__.lower()!r}); got name={name!r}."
        )
    held = registry.get(name)
    if held is not None and (held.__module__, held.__qualname__) != (
        cls.__module__,
        cls.__qualname__,
    ):
        raise PergradValueError(
            f"{cls.__qualname__}: the {kind} name {name!r} is taken by "
            f"{held.__module__}.{held.__qualname__}; register under another name=."
        )
    registry[name] = cls


def _unknown(caller: str, arg_name: str, kind: str, value: Any, names: list[str]) -> Exception:
    """The error for a ``value`` that names no registered class (or is not an instance)."""
    if isinstance(value, type) and issubclass(value, (Solver, Estimator)):
        return PergradTypeError(
            f"{caller}: {arg_name} must be a {kind} instance or name; got the class "
            f"{value.__name__}: pass {value.__name__}() (with its options)."
        )
    close = difflib.get_close_matches(value.lower(), names, 1) if isinstance(value, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    error = PergradValueError if isinstance(value, str) else PergradTypeError
    return error(
        f"{caller}: {arg_name} must be one of {names} or a pergrad.influence."
        f"{kind.capitalize()} instance (to set its options); got {value!r}{hint}."
    )


class Solver:
    """An inverse-Hessian solver: ``(H + damping I)^-1`` applied to rows of vectors.

    Subclass it with a name to register a new solver, which every function taking ``solver=``
    then accepts by that name or as an instance (see the module docstring for an example)::

        @dataclass(frozen=True)
        class MySolver(pergrad.influence.Solver, name="mine"):
            def prepare(self, caller, loss, batch, count): ...          # -> prepared
            def solve(self, caller, prepared, rows, dampings): ...      # -> list of (k, P)

    Attributes:
      registry: name -> class of every registered solver, in registration order.
    """

    registry: ClassVar[dict[str, type[Solver]]] = {}

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            _register(Solver.registry, "solver", name, cls)

    def prepare(self, caller: str, loss: FlatLoss, batch: tuple, count: int) -> Any:
        """The work that does not depend on the vectors, for ``H`` the Hessian of the mean of
        ``loss`` over ``batch`` (``count`` examples); returns what :meth:`solve` needs."""
        raise NotImplementedError(f"{type(self).__name__} must implement prepare")

    def solve(self, caller: str, prepared: Any, rows: Any, dampings: list[float]) -> list[Any]:
        """``[(H + d I)^-1 rows for d in dampings]``, rows ``(k, P)``, each result ``(k, P)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement solve")

    def inverse(
        self, caller: str, loss: FlatLoss, batch: tuple, count: int, rows: Any, dampings: list
    ) -> list[Any]:
        """:meth:`prepare` then :meth:`solve`: the one call the estimators make."""
        return self.solve(caller, self.prepare(caller, loss, batch, count), rows, dampings)


def solver_from(caller: str, solver: Any) -> Solver:
    """``solver`` as a solver object: a registered name (default options) or an instance."""
    if isinstance(solver, Solver):
        return solver
    if isinstance(solver, str) and solver.lower() in Solver.registry:
        return Solver.registry[solver.lower()]()
    raise _unknown(caller, "solver", "solver", solver, list(Solver.registry))


@dataclass(frozen=True)
class Task:
    """What an estimator attributes: the model and the functions of one example.

    Attributes:
      fn: the function of ONE training example, ``fn(params, *example) -> scalar`` (the loss;
        for TRAK the model output).
      params: the parameters, a pytree of JAX arrays or torch tensors; for estimators over
        several models (TracIn's checkpoints, TRAK's ensemble) a list of them.
      target_fn: the function of one test example whose gradient is scored; None: ``fn``.
      chunk_size: per-example gradients of this many examples at a time (None: all).
      caller: the public function, named in error messages.
      params_name: what ``caller`` calls ``params`` (``"checkpoints"`` for :func:`tracin`).
    """

    fn: Callable[..., Any]
    params: Any
    target_fn: Callable[..., Any] | None = None
    chunk_size: int | None = None
    caller: str = "pergrad.influence"
    params_name: str = "params"

    def loss(
        self, params: Any = None, arg_name: str | None = None, regularizer: Any = None
    ) -> FlatLoss:
        """``fn`` over the flat parameters of ``params`` (default ``self.params``), checked:
        a :class:`FlatLoss` whose ``grads(batch)`` are ``(n, P)`` rows."""
        return FlatLoss.create(
            self.caller,
            self.fn,
            self.params if params is None else params,
            self.chunk_size,
            arg_name=arg_name or self.params_name,
            regularizer=regularizer,
        )

    def backend(self) -> Backend:
        return backend_of(self.params, self.caller, self.params_name)


class Estimator:
    """An attribution estimator: scores of training examples against test examples.

    Subclass it with a name to register a new estimator, which :func:`pergrad.influence.top_k`
    then accepts as ``method=`` by that name or as an instance (see the module docstring for an
    example)::

        @dataclass(frozen=True)
        class MyEstimator(pergrad.influence.Estimator, name="mine"):
            def prepare(self, task, test_batch): ...    # -> score(train_batch, count)

    Attributes:
      registry: name -> class of every registered estimator, in registration order.
    """

    registry: ClassVar[dict[str, type[Estimator]]] = {}

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            _register(Estimator.registry, "estimator", name, cls)

    @classmethod
    def streams(cls) -> bool:
        """Whether it scores a training set one batch at a time (it implements ``prepare``)."""
        return cls.prepare is not Estimator.prepare

    def prepare(self, task: Task, test_batch: Any) -> Scorer:
        """Everything that does not depend on the training examples; returns
        ``score(train_batch, count) -> (count, n_test)`` for a checked tuple of ``count``
        training examples."""
        raise PergradValueError(
            f"{task.caller}: {type(self).__name__} needs the whole training set at once, so it "
            f"cannot score a stream of training batches; call its scores(task, train_batch, "
            f"test_batch)."
        )

    def scores(self, task: Task, train_batch: Any, test_batch: Any) -> Any:
        """``(n_train, n_test)`` scores, an array of the parameters' framework."""
        if not self.streams():
            raise PergradTypeError(
                f"{task.caller}: {type(self).__name__} implements neither prepare(task, "
                f"test_batch) nor scores(task, train_batch, test_batch); an Estimator needs one."
            )
        score = self.prepare(task, test_batch)
        train, count = check_batch(task.caller, "train_batch", task.backend(), train_batch)
        if task.target_fn is None:
            check_same_arity(task.caller, train, "train_batch", tuple(test_batch), "test_batch")
        return score(train, count)

    def self_scores(self, task: Task, train_batch: Any) -> Any:
        """``(n_train,)`` scores of each training example against itself."""
        raise PergradValueError(
            f"{task.caller}: {type(self).__name__} has no self-scores; use an estimator that "
            f"does, such as 'influence', 'dot' or 'tracin'."
        )


def estimator_from(caller: str, method: Any, streaming: bool = False) -> Estimator:
    """``method`` as an estimator object: a registered name (default options) or an instance;
    with ``streaming``, only estimators that score a training set batch by batch."""
    names = [n for n, c in Estimator.registry.items() if c.streams() or not streaming]
    if isinstance(method, str) and method.lower() in Estimator.registry:
        method = Estimator.registry[method.lower()]()
    if not isinstance(method, Estimator):
        raise _unknown(caller, "method", "estimator", method, names)
    if streaming and not method.streams():
        got = next((n for n, c in Estimator.registry.items() if type(method) is c), None)
        raise PergradValueError(
            f"{caller}: method must be one of {names} or an Estimator that scores training "
            f"examples batch by batch (implements prepare); got "
            f"{got if got is not None else type(method).__name__!r}, whose scores need the "
            f"whole training set at once."
            + (" Use pergrad.influence.TRAK(...).top_k for TRAK." if got == "trak" else "")
        )
    return method
