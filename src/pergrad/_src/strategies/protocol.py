"""The types every strategy and the registry share (``registry.py`` says how they are used):
a module of its own, so that the strategies can build their answers without importing the
registry that imports them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pergrad._src.core.call import Call, Spec

# weights_from(squared_norms_per_leaf) -> (B,) weights of the examples in the clipped sum, or
# one (B,) array per leaf (per-group clipping; leaves of one group share the array object)
WeightsFn = Callable[[list[Any]], Any]


def per_leaf_weights(weights: Any, num_leaves: int) -> list[Any]:
    """A ``WeightsFn``'s answer as one ``(B,)`` weight array per leaf (one array: every leaf's)."""
    return weights if isinstance(weights, list) else [weights] * num_leaves


def weight_groups(weights: Any, num_leaves: int) -> list[tuple[Any, list[int]]]:
    """``[(weights, leaf indices)]``: the leaves that share one ``(B,)`` weight array."""
    per_leaf = per_leaf_weights(weights, num_leaves)
    groups: dict[int, tuple[Any, list[int]]] = {}
    for k, w in enumerate(per_leaf):
        groups.setdefault(id(w), (w, []))[1].append(k)
    return list(groups.values())


class Reduction(NamedTuple):
    """What a strategy returns, per differentiated leaf (in the core's flat order).

    Attributes:
      squared_norms: ``(B,)`` each example's squared gradient norm, one array per leaf.
      weighted_sums: ``sum_i w_i g_i`` one array per leaf (shaped like the leaf), or None when
        no weights were asked for.
      losses: ``(B,)`` each example's loss, detached, where the strategy computed it in its
        batched pass anyway (PyTorch's ghost strategies); None elsewhere.
      rounding_bounds: per leaf, ``(B,)`` at least the rounding error of its squared norms,
        where a ghost rule computed them in a fast precision (``capture/cost.Certified``),
        else None; None: none for any leaf. ``squared_norms`` are the best estimates (what
        ``per_example_norms_of`` reports); clip weights come from :meth:`upper_squared_norms`.
    """

    squared_norms: list[Any]
    weighted_sums: list[Any] | None
    losses: Any = None
    rounding_bounds: list[Any] | None = None

    def upper_squared_norms(self) -> list[Any]:
        """Each leaf's squared norms plus their rounding bound: at least the exact ones."""
        if self.rounding_bounds is None:
            return self.squared_norms
        return [s if b is None else s + b for s, b in zip(self.squared_norms, self.rounding_bounds)]


class UserGrouping(NamedTuple):
    """A batch's examples grouped by user, for user-level clipping by a ghost strategy.

    Attributes:
      user_ids: ``(B,)`` the examples' user ids (PyTorch reads them: ``capture/torch_users``).
      mask: None, or ``(B,)``, False for padding, which joins no user.
      slots: ``dp/users.user_slots``'s ``(B, B)`` grouping (JAX reads it, traced ids too:
        ``capture/jax_users``).
    """

    user_ids: Any
    mask: Any
    slots: Any


class LeafReduction(NamedTuple):
    """One differentiated leaf's result of a plug-in reduction over one captured pass.

    Attributes:
      value: the plug-in's per-example values where ``reduced``; otherwise the leaf's
        ``(B, *leaf.shape)`` per-example gradients (its layer or contraction lacks the plug-in,
        or is not captured), which the caller reduces itself.
      reduced: which of the two ``value`` is.
    """

    value: Any
    reduced: bool


@dataclass(frozen=True)
class StrategyChoice:
    """How a call of :func:`per_example_norms_of` / :func:`clipped_sum_of` will be computed.

    Attributes:
      strategy: ``"ghost"``, ``"chunked"`` or ``"materialize"`` (never ``"auto"``).
      reason: why, in words.
      chunk_size: examples per chunk for ``"chunked"`` (the default is chosen from the number of
        parameters: ``chunk_size x P`` stays under 2**25 numbers); what was passed for
        ``"materialize"``; None for ``"ghost"``.
      layers: for a :func:`pergrad.module_loss` loss, module name -> ghost rule (``"linear"``,
        ``"conv"``, ``"embedding"``, ...) of each layer owning a differentiated parameter;
        ``"generic"`` for a layer without a rule, run alone (``torch_generic.py``). For a
        JAX loss, parameter path -> ``"linear"``, ``"conv"`` or ``"embedding"``, the
        family of the contraction it enters (the PyTorch families' names).
      unsupported: module name -> why the ghost strategy cannot handle it. For a JAX loss,
        parameter path -> why its per-example gradients are formed (the ghost strategy still
        runs; these parameters get ordinary per-example gradients in the same pass).
      norm_routes: how the ghost strategy computes each entry of ``layers``' per-example
        norms, decided per layer shape: Gram matrices of the layer's inputs and of its output
        gradients (``T x T`` per example, in float64), the per-example gradient of that layer
        formed (``p x q``), or a closed form (one position: ``|x|^2 |g|^2``; an embedding's
        rows). A PyTorch layer's route depends on the tokens per example, which only a run
        sees: it says up to how many positions the Gram route is taken. A JAX contraction's
        shapes are traced: its route is the one taken.
      plan: the analysis the ghost strategy runs from (internal).

    A ghost run can still meet something only visible while running (a layer that does not get
    the batch on axis 0, an input changed in place); ``"auto"`` then takes the chunked strategy
    and says so with a :class:`pergrad.FallbackWarning`.
    """

    strategy: str
    reason: str
    chunk_size: int | None = None
    layers: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    plan: Any = field(default=None, repr=False, compare=False)
    norm_routes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Assessment:
    """A strategy's answer for one call, before running it.

    ``choice`` carries what a ``"reduce"`` strategy reports (:class:`StrategyChoice`); a
    ``"grads"`` strategy leaves it None. A refusal may carry one too: the layers a ghost plan
    found are still reported when the call goes to the chunked strategy. ``plan``: whatever
    the strategy's run needs from its assessment (the hooks plan).
    """

    strategy: str
    accepted: bool
    why: str
    choice: StrategyChoice | None = None
    plan: Any = field(default=None, repr=False, compare=False)
    fallback: bool = False  # reached by "auto" after another strategy failed


@dataclass
class GradsRequest:
    """A call of :func:`pergrad.per_example_grads`, analysed (``api/grads.py``)."""

    spec: Spec
    call: Call
    kwargs: dict[str, Any]
    single: Callable[..., Any]
    diff_values: tuple[Any, ...]
    batched_values: tuple[Any, ...]
    batch_size: int


@dataclass
class ReduceRequest:
    """A call of ``per_example_norms_of`` / ``clipped_sum_of`` (``api/reductions.py``).

    ``materialize()`` gives the per-example gradients (:func:`pergrad.per_example_grads` of the
    same call, supplied by the entry point); ``weights_from`` maps the squared norms to the
    clipped sum's example weights (None: norms only). ``users``: None, or a
    :class:`UserGrouping` for user-level clipping by a ghost strategy, whose squared norms are
    then each user's, in the row layout of ``dp/users.user_slots``. ``clipped``: the call is
    a clipped sum's, whose ``weights_from`` is set after the strategy is chosen (the ghost
    strategy's cost model counts the layers that step holds, ``ghost_torch._route_costs``).
    ``compiled_bytes``: for a JAX call, ``strategy -> XLA's temporary bytes`` of the call
    compiled alone by that strategy (``api/compiled.py``; may raise), which the ghost strategy's
    choice under "auto" compares; None otherwise."""

    spec: Spec
    call: Call
    fn: Any
    args: tuple[Any, ...]
    chunk_size: int | None
    materialize: Callable[[], Any]
    weights_from: WeightsFn | None = None
    users: Any = None
    clipped: bool = False
    compiled_bytes: Callable[[str], int] | None = None
