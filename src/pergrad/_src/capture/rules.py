"""The registry of PyTorch layer rules: how the capture engine is taught a layer family.

A rule turns one layer's captured calls (its inputs and output gradients over one batched pass,
``LayerCall`` records) into per-example quantities of the layer's own parameters: squared
norms, per-example gradients, and sums weighted per example. One small function per family
(``torch_layers.py``), registered under the layer types it handles, as Opacus's
``grad_sample`` does; the strategies ask :func:`rule_for`, never ``isinstance``. Adding a
layer family means one file in ``torch_rules/`` whose functions are decorated with
:func:`register` (``torch_rules/bilinear.py`` is the model), including its ``route`` (how its
norms are computed, in words, for ``choose_strategy``'s ``norm_routes``).

Reductions are plug-ins: beyond the three every family has, a new per-example quantity (a
per-layer Kronecker projection of the gradient, K-FAC's factors) is written once, for both
frameworks, over the framework-free records of ``quantities.py``: a family that can show its
calls as :class:`~pergrad._src.capture.quantities.Tokens` (``tokens=``: linear, Hugging Face's
``Conv1D``, ungrouped convolutions) or :class:`~pergrad._src.capture.quantities.Lookups`
(``lookups=``: embeddings) computes every registered quantity from them. A reduction specific
to one family is taught to it with :func:`register_reduction`. Either way, nothing in the
engine or the rules changes; a strategy asks ``rule.reduction(name)``.

Precision: the built-in reductions of a registered rule always compute in at least float32 with
autocast off (:func:`in_reduction_precision`). Under ``torch.autocast`` the records are bfloat16
or float16 while the parameters are float32; squaring a float16 activation past 256 overflows,
and autocast would run the rules' own matrix products in the low dtype too, rounding the clip
factors by ``2**-9`` (so a clipped example could exceed its bound). The results come back in
the parameter's dtype (squared norms of a float16 parameter in float32, which holds them; a
float64 computation, the tied-weight path's, stays float64). A call whose float32 copies would
be large (an LM head's vocabulary-wide output gradients) is widened and reduced a chunk of
examples at a time (``widening.py``).

Beyond its functions, a rule may tell the engine how to record a call (``record``: a layer
called with keyword arguments, returning a tuple, or time-first, such as
``nn.MultiheadAttention``), which leading axes may hold the batch (``batch_axes``: a linear
layer in a time-first transformer sees ``(T, B, D)``), and which parameters of its submodules
it reduces (``nested``: the attention's ``out_proj``, never called as a module). A family
whose classes are many and not importable here (Hugging Face's RMS norms, one per model) is
registered with a ``matches`` predicate instead of types.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pergrad._src.capture.quantities import (
    BUILT_IN,
    Formed,
    Lookups,
    Tokens,
    find_reduction,
    of_records,
    quantity_named,
)
from pergrad._src.capture.widening import call_widened

# A rule takes the layer and its calls in one forward pass, and returns each of the layer's own
# parameters' per-example squared gradient norms: {"weight": (B,), "bias": (B,)}.
SquaredNormsFn = Callable[[Any, list[Any]], dict[str, Any]]
# The same calls -> each parameter's per-example gradients: {"weight": (B, *weight.shape), ...}.
PerExampleFn = Callable[[Any, list[Any]], dict[str, Any]]
# Why a particular layer instance cannot use its family's rule (None: it can).
ProblemFn = Callable[[Any], "str | None"]
# The same calls and (B,) weights -> each parameter's sum_i w_i g_i, shaped like the parameter.
WeightedSumFn = Callable[[Any, list[Any], Any], dict[str, Any]]
# A plug-in reduction: (layer, calls, *its own arguments) -> {param_name: per-example values}.
ReductionFn = Callable[..., dict[str, Any]]
# How one call is recorded: (layer, positional args, keyword args, output) -> Recorded, or None
# to record it as a plain layer (see Recorded). Raises Unsupported to refuse the call.
RecordFn = Callable[[Any, tuple, dict, Any], "Recorded | None"]
# Whether one call computes what the rule assumes: (layer, positional args, keyword args,
# output) -> None, the call then recorded as a plain layer. Raises Unsupported to refuse it.
CheckFn = Callable[[Any, tuple, dict, Any], None]
# Whether a layer (of a type no rule is registered for) belongs to a family: (layer) -> bool.
MatchFn = Callable[[Any], bool]
# How the family's squared norms are computed for this layer's shape, in words (for
# choose_strategy's norm_routes): (layer) -> str.
RouteFn = Callable[[Any], str]
# The calls as framework-free records (quantities.py), or None where this instance has none.
TokensFn = Callable[[Any, list[Any]], "Tokens | None"]
LookupsFn = Callable[[Any, list[Any]], "Lookups | None"]


@dataclass(frozen=True)
class Recorded:
    """What the capture engine keeps of one call of a layer whose rule has a ``record``.

    A plain layer's call is recorded as its positional inputs and its (tensor) output, the batch
    on axis 0 of both (or on one of its rule's ``batch_axes``); a rule's ``record`` says instead:

    Attributes:
      inputs: the ``LayerCall.inputs`` its functions will get (tensors batch first, and whatever
        else they need: masks, flags, the parameter values the forward pass used).
      output: the tensor whose gradient is the call's ``output_grad``.
      batch_axis: the axis of ``output`` that holds the batch: its gradient is recorded with
        that axis moved to the front.
      unread: other outputs the rule does not read (attention weights): a gradient reaching one
        of them (the loss uses it) refuses the call.
    """

    inputs: tuple[Any, ...]
    output: Any
    batch_axis: int = 0
    unread: tuple[Any, ...] = ()


@dataclass(frozen=True)
class LayerRule:
    """How the ghost strategy handles one family of layers.

    Attributes:
      name: the family, as reported by :func:`pergrad.norms.choose_strategy` (``"linear"``).
      squared_norms: ``squared_norms(layer, calls) -> {param_name: (B,)}``, ``calls`` being the
        layer's :class:`~pergrad._src.capture.torch_layers.LayerCall` records of one forward pass.
      problem: ``problem(layer) -> str | None``: why this instance is not covered (an Embedding
        with ``max_norm``, say), or None.
      per_example: ``per_example(layer, calls) -> {param_name: (B, *param_shape)}``, the
        per-example gradients themselves, for the ``"hooks"`` strategy of
        :func:`pergrad.per_example_grads`.
      weighted_sum: ``weighted_sum(layer, calls, weights) -> {param_name: sum_i w_i g_i}``
        without forming the per-example gradients, for clipped sums; None: the ``per_example``
        gradients are contracted with the weights (fine where they are as small as an
        activation).
      record: how the engine records a call (see :class:`Recorded`); None: a plain layer.
      check: ``check(layer, args, kwargs, output)``, for a plain layer whose family is found by
        a predicate (``matches``): raises ``Unsupported`` where the call does not compute what
        the rule assumes, and changes nothing of what is recorded. The eager capture runs it
        at every call; the whole-graph capture of a ``torch.compile`` d model
        (``torch_compiled.py``) on the eager run of each of its layouts, outside the graph,
        which a layer with a ``record`` keeps out of.
      batch_axes: the leading axes of a plain layer's input and output that may hold the batch,
        the first of them with the batch size being taken (moved to the front). ``(0, 1)`` for
        families that treat every leading axis alike (a linear layer in a time-first
        transformer); the first run of each layout checks the choice (``torch_checks.py``).
      nested: parameters of submodules that the rule reduces, named relative to the layer
        (``("out_proj.weight", "out_proj.bias")``): the submodule is never called as a module.
      route: ``route(layer) -> str``, how ``squared_norms`` computes this layer's norms, in
        words (``StrategyChoice.norm_routes``).
      tokens: ``tokens(layer, calls) -> Tokens | None``: the calls as the inputs and output
        gradients of a linear map of the weight (``quantities.py``), for the quantities
        registered with ``register_quantity``; None: the family has no such form.
      lookups: ``lookups(layer, calls) -> Lookups | None``: the same for a table read by rows.
      plugins: reductions added with :func:`register_reduction`, by name.
    """

    name: str
    squared_norms: SquaredNormsFn
    problem: ProblemFn
    per_example: PerExampleFn
    weighted_sum: WeightedSumFn | None = None
    record: RecordFn | None = None
    batch_axes: tuple[int, ...] = (0,)
    nested: tuple[str, ...] = ()
    route: RouteFn = field(default=lambda layer: "per-example gradients formed", compare=False)
    tokens: TokensFn | None = None
    lookups: LookupsFn | None = None
    plugins: dict[str, ReductionFn] = field(default_factory=dict, compare=False)
    check: CheckFn | None = None

    def reduction(self, name: str) -> ReductionFn | None:
        """The family's function for reduction ``name``: a built-in, a plug-in of this family,
        or a registered quantity where the family has records for it; else None."""
        return find_reduction(self, name, _of_quantity)


def _of_quantity(rule: LayerRule, quantity: Any, layer: Any, calls: list[Any], *args: Any) -> Any:
    """A registered quantity of the layer's weight from its records; its bias's per-example
    gradients (``d`` summed over positions) :class:`Formed`. Empty (every parameter's gradient
    formed by the caller) where this instance has no record the quantity takes."""
    tokens = rule.tokens(layer, calls) if rule.tokens is not None else None
    lookups = rule.lookups(layer, calls) if rule.lookups is not None and tokens is None else None
    value = of_records(quantity, tokens, lookups, args)
    if value is None:
        return {}
    result = {"weight": value}
    if tokens is not None and getattr(layer, "bias", None) is not None:
        result["bias"] = Formed(tokens.d.sum(1))
    return result


# Keyed by the layer's class, or by "module.QualName" for classes of libraries pergrad does not
# import (Hugging Face's Conv1D): importing transformers to register a rule would cost seconds.
_RULES: dict[type | str, LayerRule] = {}
# Families found by a predicate, tried in order when no type matches.
_MATCHERS: list[tuple[MatchFn, LayerRule]] = []


def _no_problem(layer: Any) -> None:
    del layer


def register(
    *layer_types: type | str,
    name: str,
    per_example: PerExampleFn,
    problem: ProblemFn = _no_problem,
    weighted_sum: WeightedSumFn | None = None,
    record: RecordFn | None = None,
    batch_axes: tuple[int, ...] = (0,),
    nested: tuple[str, ...] = (),
    matches: MatchFn | None = None,
    route: RouteFn | None = None,
    tokens: TokensFn | None = None,
    lookups: LookupsFn | None = None,
    check: CheckFn | None = None,
) -> Callable[[SquaredNormsFn], SquaredNormsFn]:
    """Decorator: register ``squared_norms`` (and ``per_example``) as the rule of ``layer_types``.

    A type is a class, or the ``"module.QualName"`` of one. Types are matched exactly, not by
    subclass: a subclass may override ``forward`` and compute something the rule does not know.
    ``matches(layer) -> bool`` registers a family by a predicate instead (tried after the
    types), for classes pergrad cannot list; its ``check`` (or its ``record``) must then check
    that the layer computes what the rule assumes. A rule written without ``weighted_sum`` gets one that
    contracts its ``per_example`` gradients with the weights (fine where those are as small as
    an activation). All three run through :func:`in_reduction_precision`. ``record``,
    ``check``, ``batch_axes``, ``nested``, ``route`` (default: "per-example gradients
    formed"), ``tokens`` and ``lookups``: see :class:`LayerRule`.
    """

    def decorate(squared_norms: SquaredNormsFn) -> SquaredNormsFn:
        summed = weighted_sum if weighted_sum is not None else _contracted(per_example)
        rule = LayerRule(
            name,
            _in_precision(squared_norms, squared=True),
            problem,
            _in_precision(per_example),
            _in_precision(summed, summed=True),
            record,
            batch_axes,
            nested,
            **({} if route is None else {"route": route}),
            tokens=tokens,
            lookups=lookups,
            check=check,
        )
        for layer_type in layer_types:
            _RULES[layer_type] = rule
        if matches is not None:
            _MATCHERS.append((matches, rule))
        return squared_norms

    return decorate


def _contracted(per_example: PerExampleFn) -> WeightedSumFn:
    def weighted_sum(layer: Any, calls: list[Any], weights: Any) -> dict[str, Any]:
        grads = per_example(layer, calls)
        return {k: _contract(weights.to(g.dtype), g) for k, g in grads.items()}

    return weighted_sum


def _contract(weights: Any, grads: Any) -> Any:
    """``sum_i w_i g_i`` for ``(B,)`` weights and ``(B, ...)`` gradients."""
    import torch

    return torch.tensordot(weights, grads, dims=1)


@contextlib.contextmanager
def in_reduction_precision(device: Any) -> Iterator[None]:
    """Autocast and TF32 off for the arithmetic inside: pergrad's own products of records,
    norms and clip factors run in the dtype of their operands, not autocast's, and float32
    products in float32, not TensorFloat-32 (:func:`full_float32`)."""
    import torch

    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    with full_float32():
        if device_type == "meta" or not torch.is_autocast_enabled(device_type):
            yield
            return
        with torch.autocast(device_type, enabled=False):
            yield


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """float32 matrix products and convolutions in float32 inside, not TensorFloat-32; the
    user's settings as they were after.

    On a GPU a TF32 product rounds its inputs to 10 bits (relative error ``2**-11``): set by
    ``torch.set_float32_matmul_precision("high")``, ``torch.backends.cuda.matmul.allow_tf32``,
    and cuDNN's convolutions by default. The certified norms' bounds assume float32's
    ``2**-24``; under TF32 a norm could be ``~1e-3`` too small and its example exceed the clip
    bound. Set and restored through torch's per-backend ``fp32_precision`` flags, which keep
    either API the user set (reading the old API's flags after the new one's were written
    raises in torch >= 2.9). oneDNN's products on a CPU have the same flags (``"bf16"`` after
    ``torch.set_float32_matmul_precision("medium")``); setting them costs nothing."""
    flags = fp32_precision_flags()
    if not flags:  # torch < 2.9: the old API alone
        with _without_tf32_flags():
            yield
        return
    before = [flag.fp32_precision for flag in flags]
    if all(value == "ieee" for value in before):
        yield
        return
    for flag in flags:
        flag.fp32_precision = "ieee"
    try:
        yield
    finally:
        for flag, value in zip(flags, before):
            flag.fp32_precision = value


@functools.cache
def fp32_precision_flags() -> list[Any]:
    """torch's per-backend ``fp32_precision`` flags of float32 products (cuBLAS, cuDNN's
    convolutions, oneDNN's products and convolutions on a CPU); empty before torch 2.9. (The
    flag objects are torch's module-level singletons: looked up once, not at every rule call.)"""
    import torch

    backends = torch.backends
    owners = [getattr(backends.cuda, "matmul", None), getattr(backends.cudnn, "conv", None)]
    mkldnn = getattr(backends, "mkldnn", None)
    owners += [getattr(mkldnn, "matmul", None), getattr(mkldnn, "conv", None)]
    return [flag for flag in owners if flag is not None and hasattr(flag, "fp32_precision")]


@contextlib.contextmanager
def _without_tf32_flags() -> Iterator[None]:
    import torch

    flags = (torch.backends.cuda.matmul, torch.backends.cudnn)
    before = [flag.allow_tf32 for flag in flags]
    for flag in flags:
        flag.allow_tf32 = False
    try:
        yield
    finally:
        for flag, value in zip(flags, before):
            flag.allow_tf32 = value


def _in_precision(
    fn: Callable[..., dict[str, Any]], squared: bool = False, summed: bool = False
) -> Any:
    """``fn(layer, calls, *args)`` on calls widened to float32 (whole, or a chunk of examples
    at a time where the copy would be large: ``widening.py``; ``summed``: ``fn`` gives weighted
    sums), autocast off; each result in its parameter's dtype (see the module docstring)."""
    import torch

    @functools.wraps(fn)
    def run(layer: Any, calls: list[Any], *args: Any) -> dict[str, Any]:
        sum_size = functools.partial(_reduced_numbers, layer) if summed else None
        with in_reduction_precision(calls[0].output_grad.device):
            values = call_widened(fn, layer, calls, args, sum_size)
        result = {}
        for key, value in values.items():
            param = _parameter(layer, key)
            dtype = param.dtype if isinstance(param, torch.Tensor) else value.dtype
            if value.dtype == torch.float64 or (squared and dtype == torch.float16):
                dtype = value.dtype  # float64 asked for; float16 cannot hold squared norms
            result[key] = value.to(dtype)
        return result

    return run


def _reduced_numbers(layer: Any) -> int:
    """How many numbers the layer's reduced parameters hold (their full size, where FSDP
    shards them): the size of its weighted sums."""
    return sum(param.numel() for _, param in layer_parameters(layer))


def _parameter(layer: Any, key: str) -> Any:
    """The layer's parameter ``key`` (``"out_proj.weight"`` for a nested one), or None."""
    owner, _, attribute = key.rpartition(".")
    for part in owner.split(".") if owner else ():
        layer = getattr(layer, part, None)
    return getattr(layer, attribute, None)


def rule_for(layer: Any) -> LayerRule | None:
    """The rule registered for ``type(layer)``, or the first family whose predicate matches
    the layer, or None."""
    cls = _unsharded_class(type(layer))
    rule = _RULES.get(cls)
    if rule is None:
        rule = _RULES.get(f"{cls.__module__}.{cls.__qualname__}")
    if rule is None:
        rule = next((rule for matches, rule in _MATCHERS if matches(layer)), None)
    return rule


def _unsharded_class(cls: type) -> type:
    """The layer's own class where FSDP2's ``fully_shard`` swapped it for its dynamic subclass
    ``FSDP<Name>(FSDPModule, <Name>)``, whose forward is the original's (matched by name, so
    that this module does not import ``torch.distributed``)."""
    bases = cls.__bases__
    if (
        len(bases) == 2
        and bases[0].__name__ == "FSDPModule"
        and cls.__name__ == f"FSDP{bases[1].__name__}"
    ):
        return bases[1]
    return cls


def layer_parameters(layer: Any) -> list[tuple[str, Any]]:
    """``(name relative to the layer, parameter)`` of each parameter its rule reduces: the
    layer's own and those of its rule's ``nested`` submodules."""
    own = list(layer.named_parameters(recurse=False))
    rule = rule_for(layer)
    for name in rule.nested if rule is not None else ():
        param = _parameter(layer, name)
        if param is not None:
            own.append((name, param))
    return own


def parameter_owners(model: Any) -> dict[str, tuple[str, str]]:
    """Every name of a parameter of ``model`` (duplicates included) -> ``(the layer that
    reduces it, its name relative to that layer)``: the module holding it, or an ancestor
    whose rule lists it in ``nested`` (``"attn.out_proj.weight" -> ("attn",
    "out_proj.weight")``)."""
    owners = {}
    for full, _ in model.named_parameters(remove_duplicate=False):
        module_name, _, attribute = full.rpartition(".")
        owners[full] = (module_name, attribute)
    for module_name, module in model.named_modules(remove_duplicate=False):
        rule = rule_for(module)
        for name in rule.nested if rule is not None else ():
            full = f"{module_name}.{name}" if module_name else name
            if full in owners:
                owners[full] = (module_name, name)
    return owners


# Plug-in reductions that add over a tied parameter's uses (see register_reduction).
_ADDITIVE: set[str] = set()


def is_additive(reduction: str) -> bool:
    """Whether plug-in ``reduction`` was registered with ``additive=True`` (a family's own
    plug-in, or a registered quantity)."""
    quantity = quantity_named(reduction)
    return reduction in _ADDITIVE or (quantity is not None and quantity.additive)


def register_reduction(
    reduction: str, family: str, additive: bool = False
) -> Callable[[ReductionFn], ReductionFn]:
    """Decorator: teach the layer family ``family`` (a rule's name: ``"linear"``, ``"conv"``,
    ...) the plug-in reduction ``reduction``, ``fn(layer, calls, *args) -> {param: values}``.

    ``additive``: the reduction is linear in the per-example gradient, and each family gives a
    parameter's values in a frame of the parameter's own (the same for every layer using it),
    so that a parameter tied across layers (an embedding table that is also the output layer)
    gets the sum of its uses' values; otherwise its per-example gradient is formed. One setting
    per reduction name, the last registration's.

    Raises ``ValueError`` for an unknown family, or a name that is one of the built-in three.
    """
    if reduction in BUILT_IN:
        raise ValueError(
            f"register_reduction: {reduction!r} is a built-in reduction of every family "
            f"({', '.join(BUILT_IN)}); give the plug-in a name of its own."
        )
    every = [*_RULES.values(), *(rule for _, rule in _MATCHERS)]
    rules = {id(rule): rule for rule in every if rule.name == family}
    if not rules:
        known = sorted({rule.name for rule in every})
        raise ValueError(f"register_reduction: no layer family {family!r}; known: {known}.")

    def decorate(fn: ReductionFn) -> ReductionFn:
        for rule in rules.values():
            rule.plugins[reduction] = fn
        if additive:
            _ADDITIVE.add(reduction)
        else:
            _ADDITIVE.discard(reduction)
        return fn

    return decorate
