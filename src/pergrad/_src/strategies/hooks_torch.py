"""The ``"hooks"`` strategy of :func:`pergrad.per_example_grads`: per-example gradients from layer
hooks, for PyTorch models wrapped by :func:`pergrad.module_loss`.

Where ``torch.func.vmap`` cannot batch a model (activation checkpointing, Hugging Face attention
masks with data-dependent branches, custom ``autograd.Function`` s without a vmap rule), plain
autograd still runs it on the whole batch. The hooks keep, for every layer owning a parameter,
its input and the gradient at its output; each layer family's rule (``capture/torch_layers.py``)
turns those into the per-example gradients of its parameters (for a linear layer,
``sum_t d_t a_t^T`` per example). One forward and one backward pass over the batch, as Opacus's
``GradSampleModule`` and BackPACK's ``BatchGrad`` do.

It is only used when it is right, and checked while it runs:

- every differentiated parameter must belong to layers with a rule (:func:`plan`); a parameter
  shared by several layers (GPT-2's tied input and output embeddings) gets the sum of the
  per-example gradients of each use, as autograd gives;
- on the first call of each layout, the per-example gradients must add up to the batch
  gradient of the same backward pass; a use of a parameter the hooks did not see
  (``F.linear(x, self.fc.weight)`` in a parent module) breaks that sum and the call is refused
  (``"auto"`` then loops). Once a layout has passed its checks, its later calls differentiate
  only the hooked layers' outputs (no weight gradient is computed: a third of a training
  step's work), as the ghost strategy does;
- on the first call of each layout (the arguments' and the records' shapes, each dimension
  equal to the batch size marked: ``torch_checks.records_signature``), each hooked
  layer's output gradient must be row-local (``capture/torch_checks.py``: a second, weighted
  backward pass), so a layer that has the batch size on axis 0 without holding the batch there
  (time-first with ``T == B``) is refused; and the first 64 examples are run alone (forward
  only) and must get the loss they got in the batch, and example 0's gradient alone must equal
  row 0: a model whose output for one example depends on the others (batch statistics, an
  ``if`` on a batch-wide value) is refused the same way. (With ``randomness="different"`` only
  the row check: the draws differ run to run.)

Activation checkpointing with ``use_reentrant=True`` recomputes the forward pass with the model's
own parameters and cannot be differentiated with ``torch.autograd.grad``; for it, the batch is
run through the model's own parameters with ``.backward()``, and every parameter's ``.grad``
(the model's and a loss module's) is put back as it was afterwards; hooks the user registered on
parameters do fire in that backward pass.

Limits: the checks run on the first call of each layout with two or more examples; a model that
branches on a batch-wide value, or uses a parameter outside its layer, only on some later batch
of the same shapes is not caught after that. Pass ``strategy="loop"`` for such models.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pergrad._src.capture import torch_checks
from pergrad._src.capture.rules import rule_for
from pergrad._src.capture.torch_engine import (
    capturing,
    layer_calls,
    model_and_loss_arguments,
    per_example_losses,
)
from pergrad._src.capture.torch_plan import uses_and_aliases
from pergrad._src.core.call import Call, Spec
from pergrad._src.core.module_loss import ModuleLoss, refuse_batch_mixing_layers
from pergrad._src.errors import PergradValueError, Unsupported, is_pergrad_error
from pergrad._src.strategies.protocol import Assessment, GradsRequest
from pergrad._src.strategies.vmap import vmap_failure

_LOSS_CHECKS = 64  # examples whose loss alone is compared on the first call


@dataclass(frozen=True)
class HooksPlan:
    """Which layers the hooks must watch, and what they cannot cover.

    Attributes:
      owners: parameter name (as in ``params``) -> the ``(module_name, attribute)`` of every
        layer using it (two for tied weights).
      unsupported: parameter or module name -> why the hooks cannot give its gradients.
    """

    owners: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)

    @property
    def modules(self) -> list[str]:
        return sorted({module for uses in self.owners.values() for module, _ in uses})


def plan(spec: Spec, loss: Any, params: Any) -> HooksPlan:
    """Check, without running anything, whether the hooks can give every parameter's gradient."""
    if not isinstance(loss, ModuleLoss):
        return HooksPlan(unsupported={"fn": "layer hooks need a loss made by pergrad.module_loss"})
    if spec.argnums != (0,) or not spec.single_argnum:
        return HooksPlan(unsupported={"argnums": "the hooks differentiate the parameters only"})
    if spec.has_aux:
        return HooksPlan(unsupported={"has_aux": "the hooks take a loss without aux outputs"})
    if spec.randomness == "same":
        return HooksPlan(
            unsupported={"randomness": "'same' (one draw for all examples) needs a loop"}
        )
    if not (
        isinstance(params, dict)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in params.items())
    ):
        return HooksPlan(unsupported={"params": "the hooks need a dict[str, Tensor] of parameters"})
    uses_of, modules = _ownership(loss, params)
    owners, unsupported = {}, {}
    for name in params:
        if name not in uses_of:
            unsupported[name] = "not a parameter of the model"
            continue
        uses = uses_of[name]
        for module_name, _ in uses:
            module = modules[module_name]
            rule = rule_for(module)
            problem = rule.problem(module) if rule is not None else None
            if rule is None:
                unsupported[module_name or name] = f"no layer rule for {type(module).__name__}"
            elif problem is not None:
                unsupported[module_name or name] = f"{type(module).__name__}: {problem}"
        owners[name] = uses
    return HooksPlan(owners, unsupported)


# Each loss's last ownership of its parameters, under the model's structure it was worked out
# from (see _ownership).
_OWNERSHIP: weakref.WeakKeyDictionary[ModuleLoss, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def _ownership(
    loss: ModuleLoss, params: dict[str, torch.Tensor]
) -> tuple[dict[str, list[tuple[str, str]]], dict[str, nn.Module]]:
    """The layers using each parameter, as the ghost strategy plans with (a module registered
    under two names is one layer; a rule's nested parameters, attention's out_proj, belong to
    its layer), and every module by name.

    Working the uses out walks the model (0.2 ms a call on the bench transformer, 4% of its
    batch gradient, and "auto" plans every call): they are kept on the loss, under what they
    depend on, read afresh at each call: the parameter names asked for, every module (name,
    object, class, rule) and every parameter (name, object)."""
    model = loss.model
    modules = dict(model.named_modules(remove_duplicate=False))
    structure = (
        tuple(params),
        tuple((name, id(m), type(m), id(rule_for(m))) for name, m in modules.items()),
        tuple((name, id(p)) for name, p in model.named_parameters(remove_duplicate=False)),
    )
    kept = _OWNERSHIP.get(loss)
    if kept is not None and kept[0] == structure:
        return kept[1], modules
    uses_of, _ = uses_and_aliases(model, params)
    _OWNERSHIP[loss] = (structure, uses_of)
    return uses_of, modules


def own_parameters(loss: ModuleLoss, params: dict[str, torch.Tensor]) -> bool:
    """Whether ``params`` are views of the model's own parameters (as ``loss.params()`` gives)."""
    by_name = dict(loss.model.named_parameters(remove_duplicate=False))
    return all(
        name in by_name
        and value.data_ptr() == by_name[name].data_ptr()
        and value.shape == by_name[name].shape
        and value.stride() == by_name[name].stride()
        for name, value in params.items()
    )


def value_and_grads(
    spec: Spec,
    call: Call,
    hooks_plan: HooksPlan,
    single: Callable[..., Any],
    diff_values: tuple[Any, ...],
    batched_values: tuple[Any, ...],
    batch_size: int,
) -> tuple[Any, list[Any]]:
    """``(losses (B,), per-example gradient leaves)`` by the hooks, chunk by chunk.

    Raises :class:`Unsupported` when a check fails (see the module docstring).
    """
    loss: ModuleLoss = spec.fn  # type: ignore[assignment]
    refuse_batch_mixing_layers(loss.model, spec.func_name)
    key = torch_checks.layout_key(
        hooks_plan.owners, [x for leaves in call.leaves[1:] for x in leaves], batch_size
    )
    verify = not torch_checks.has_checked(loss, "hooks", key)
    try:
        results, seen = _passes(
            spec, call, hooks_plan, diff_values, batched_values, batch_size, key, verify
        )
    except _Unchecked:  # a layout checked at other record shapes (T == B): check this one
        verify = True
        results, seen = _passes(
            spec, call, hooks_plan, diff_values, batched_values, batch_size, key, verify
        )
    if len(results) == 1:  # one chunk: its tensors as they are (a cat would copy B x P numbers)
        losses, grads = results[0][0], list(results[0][1])
    else:
        losses = torch.cat([r[0] for r in results])
        grads = [torch.cat(column) for column in zip(*(r[1] for r in results))]
    if verify and _check_examples_independent(
        spec, call, hooks_plan, single, diff_values, batched_values, losses, grads
    ):
        for signature in seen:
            torch_checks.mark_checked(loss, "hooks", key, signature)
    return losses, grads


class _Unchecked(Exception):
    """A light pass met records of a shape its layout's checks did not see."""


def _passes(
    spec: Spec,
    call: Call,
    hooks_plan: HooksPlan,
    diff_values: tuple[Any, ...],
    batched_values: tuple[Any, ...],
    batch_size: int,
    key: tuple[Any, ...],
    verify: bool,
) -> tuple[list[Any], set[Any]]:
    """Each chunk's ``(losses, grads)``, and the signatures of their records
    (``torch_checks.records_signature``). Unless ``verify``, raises :class:`_Unchecked` when a
    chunk's records have a signature the checks of layout ``key`` did not pass."""
    loss: ModuleLoss = spec.fn  # type: ignore[assignment]
    seen: set[Any] = set()

    def observe(records: dict[str, list[Any]], size: int) -> None:
        signature = torch_checks.records_signature(records, size)
        if not verify and not torch_checks.is_checked(loss, "hooks", key, signature):
            raise _Unchecked
        seen.add(signature)

    chunk = spec.chunk_size or batch_size
    results = []
    for start in range(0, batch_size, chunk):
        rows = tuple(v[start : start + chunk] for v in batched_values)
        size = min(chunk, batch_size - start)
        results.append(_one_pass(spec, call, hooks_plan, diff_values, rows, size, verify, observe))
    return results, seen


def _check_examples_independent(
    spec: Spec,
    call: Call,
    hooks_plan: HooksPlan,
    single: Callable[..., Any],
    diff_values: tuple[Any, ...],
    batched_values: tuple[Any, ...],
    losses: torch.Tensor,
    grads: list[Any],
) -> bool:
    """The hooks run the model on the whole batch; per-example gradients are defined on one
    example at a time. They agree when examples do not interact (no batch statistics, no branch
    on a batch-wide value): checked on the first call by running examples alone, the losses of
    the first ``_LOSS_CHECKS`` (forward passes only) and the gradient of example 0."""
    batch_size = losses.shape[0]
    if batch_size < 2:
        return False  # not checked: the next call checks
    if spec.randomness == "different":  # random draws differ run to run: rows checked only
        return True
    problem = (
        "the model's output for an example depends on the other examples in the batch "
        "(batch statistics, or a branch on a value of the whole batch)"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. checkpointing's no-grad notes, said once already
        index = torch_checks.check_losses_alone(
            single, diff_values, batched_values, losses, _LOSS_CHECKS
        )
    if index is not None:
        raise Unsupported(f"{problem}: example {index}'s loss differs when alone")
    _, alone_grads = _one_pass(
        spec, call, hooks_plan, diff_values, tuple(v[:1] for v in batched_values), 1, False
    )
    errors = [torch.linalg.vector_norm(g[0] - a[0]) for g, a in zip(grads, alone_grads)]
    scales = [torch.linalg.vector_norm(a[0]) for a in alone_grads]
    largest = max((float(s) for s in scales), default=0.0)
    for error, scale, alone in zip(errors, scales, alone_grads):
        # as in _check_sums: a gradient that cancels to rounding noise is judged at the
        # scale of the whole model's gradient
        allowed = torch_checks.TOLERANCES["gradient_alone"].of(alone.dtype) * scale
        if error > allowed + torch.finfo(alone.dtype).eps * largest:
            raise Unsupported(f"{problem}: example 0's gradient differs when alone")
    return True


def _one_pass(
    spec: Spec,
    call: Call,
    hooks_plan: HooksPlan,
    diff_values: tuple[Any, ...],
    batched_values: tuple[Any, ...],
    batch_size: int,
    verify: bool,
    observe: Callable[[dict[str, list[Any]], int], None] | None = None,
) -> tuple[Any, list[Any]]:
    """One forward and backward pass of the batch; with ``verify``, the layout's checks of
    ``torch_checks.check_rows`` too. ``observe(records, batch_size)``: called after the
    forward pass, before any backward pass (it may raise)."""
    loss: ModuleLoss = spec.fn  # type: ignore[assignment]
    model = loss.model
    modules = {name: model.get_submodule(name) for name in hooks_plan.modules}
    diff = [x.detach().requires_grad_(True) for x in diff_values]
    args = call.rebuild(diff, batched_values)
    params = args[0]
    inputs, targets, target_dims = model_and_loss_arguments(call, args, loss.num_inputs, batch_size)
    rng = call.backend.rng_state()
    arguments = (spec, loss, params, diff, modules, inputs, targets, target_dims, batch_size)
    try:
        losses, records, batch_grads = _forward_backward(*arguments, verify, observe)
    except RuntimeError as err:
        if "use_reentrant=True" not in str(err):
            raise
        losses, records, batch_grads = _forward_backward_own(*arguments, verify, observe)
    if spec.randomness in (None, "error") and call.backend.rng_state_changed(rng):
        raise PergradValueError(
            f"{spec.func_name}: fn draws random numbers (e.g. dropout). Pass "
            f"randomness='different' for independent randomness per example, or switch it "
            f"off (model.eval())."
        )
    per_example = _gather(modules, records)
    position = {id(leaf): k for k, leaf in enumerate(diff)}
    grads: list[Any] = [None] * len(diff)
    for name, value in params.items():
        k = position[id(value)]
        total = None
        for module_name, attribute in hooks_plan.owners[name]:
            part = per_example.get((module_name, attribute))
            if part is not None:
                total = part if total is None else total + part
        if total is None:  # no use of the parameter reached the loss
            total = value.new_zeros(batch_size, *value.shape)
        grads[k] = total.detach()
    if batch_grads is not None:  # (None: a checked layout's light backward pass)
        _check_sums(params, position, grads, batch_grads)
    return losses.detach(), grads


def _batched_pass(
    spec: Spec,
    loss: ModuleLoss,
    params: dict[str, torch.Tensor] | None,
    modules: dict[str, nn.Module],
    inputs: tuple[Any, ...],
    targets: list[Any],
    target_dims: list[Any],
    batch_size: int,
    backward: Callable[..., list[Any] | None],
    verify: bool,
    observe: Callable[[dict[str, list[Any]], int], None] | None,
) -> tuple[Any, Any, list[Any] | None]:
    """Forward the batch with the layers hooked, then ``backward(sum of losses, retain,
    records)`` -> batch gradients (or None: only the layers' outputs were differentiated);
    with ``verify`` (and two examples or more), a second, weighted backward pass checks that
    each layer's output gradient is row-local. The backward passes stay inside the hooks:
    reentrant checkpointing reruns the forward pass there."""
    row_checks = verify and batch_size > 1
    with torch.enable_grad(), capturing(modules, batch_size) as records:
        try:
            output = loss.forward(params, inputs)
            losses = per_example_losses(spec, loss, output, targets, target_dims, batch_size)
            if observe is not None:
                observe(records, batch_size)
            batch_grads = backward(losses.sum(), row_checks, records)
            if row_checks:
                torch_checks.check_rows(
                    records,
                    lambda weights: backward((losses * weights).sum(), False, records),
                    torch_checks.row_weights(batch_size, losses),
                )
        finally:
            _let_go_of_outputs(records)
    return losses, records, batch_grads


def _let_go_of_outputs(records: dict[str, list[Any]]) -> None:
    """Drop each record's output (and the input kept beside it) once the backward passes are
    done. A recorded output holds its ``grad_fn``, which holds the tensor hook that fills the
    record: a cycle through autograd's C++ objects that Python's collector cannot see, so
    the pass's whole graph and records (9 MiB a call on the bench transformer) would never be
    freed, and every call would take fresh pages from the system."""
    for layer_records in records.values():
        for record in layer_records:
            record.output = record.light_input = None


def _forward_backward(
    spec: Spec,
    loss: ModuleLoss,
    params: dict[str, torch.Tensor],
    diff: list[torch.Tensor],
    modules: dict[str, nn.Module],
    inputs: tuple[Any, ...],
    targets: list[Any],
    target_dims: list[Any],
    batch_size: int,
    verify: bool,
    observe: Callable[[dict[str, list[Any]], int], None] | None,
) -> tuple[Any, Any, list[Any]]:
    """The batch through ``functional_call`` with fresh leaves: nothing of the model is touched.
    Unless ``verify``, only the hooked layers' outputs are differentiated (:func:`_outputs`),
    where none has been changed in place since its layer returned it."""

    def backward(total: torch.Tensor, retain: bool, records: Any) -> list[Any] | None:
        outputs = None if verify else _outputs(records)
        if outputs is not None:
            torch.autograd.grad(total, outputs, allow_unused=True, retain_graph=retain)
            return None
        return list(torch.autograd.grad(total, diff, allow_unused=True, retain_graph=retain))

    return _batched_pass(
        spec,
        loss,
        params,
        modules,
        inputs,
        targets,
        target_dims,
        batch_size,
        backward,
        verify,
        observe,
    )


def _forward_backward_own(
    spec: Spec,
    loss: ModuleLoss,
    params: dict[str, torch.Tensor],
    diff: list[torch.Tensor],
    modules: dict[str, nn.Module],
    inputs: tuple[Any, ...],
    targets: list[Any],
    target_dims: list[Any],
    batch_size: int,
    verify: bool,
    observe: Callable[[dict[str, list[Any]], int], None] | None,
) -> tuple[Any, Any, list[Any]]:
    """The batch through the model's own parameters and ``.backward()`` (reentrant
    checkpointing); every ``.grad`` is restored afterwards. Batch gradients in ``diff`` order."""
    if not own_parameters(loss, params):
        raise Unsupported(
            "checkpointing with use_reentrant=True recomputes the forward pass with the "
            "model's own parameters, and params are not those (pass loss.params())"
        )
    model = loss.model
    by_name = dict(model.named_parameters(remove_duplicate=False))
    leaf_names = {id(leaf): name for name, leaf in params.items()}
    # .backward() writes .grad of every leaf it reaches: the model's, and a loss module's
    touched = list(model.parameters())
    if isinstance(loss.loss_fn, nn.Module):
        touched += list(loss.loss_fn.parameters())
    saved = [p.grad for p in touched]
    try:
        for p in touched:
            p.grad = None

        def backward(total: torch.Tensor, retain: bool, records: Any) -> list[Any]:
            total.backward(retain_graph=retain)
            grads = [by_name[leaf_names[id(leaf)]].grad for leaf in diff]
            for p in touched:  # a second (checking) pass must not add to these
                p.grad = None
            return grads

        return _batched_pass(
            spec,
            loss,
            None,
            modules,
            inputs,
            targets,
            target_dims,
            batch_size,
            backward,
            verify,
            observe,
        )
    finally:
        for p, grad in zip(touched, saved):
            p.grad = grad


def _outputs(records: dict[str, list[Any]]) -> list[torch.Tensor] | None:
    """Every hooked call's recorded output, to differentiate instead of the parameters (the
    tensor hooks on them fill the records; no weight gradient is computed), or None where an
    in-place op has changed one since its layer returned it (its hook would not see the
    gradient that reaches the layer)."""
    outputs = {}
    for layer_records in records.values():
        for r in layer_records:
            if r.output is None:
                continue
            if r.output._version != r.output_version:
                return None
            outputs[id(r.output)] = r.output
    return list(outputs.values()) or None


def _gather(
    modules: dict[str, nn.Module], records: dict[str, list[Any]]
) -> dict[tuple[str, str], torch.Tensor]:
    """``(module_name, attribute) -> (B, *shape)`` from each layer's rule."""
    result = {}
    with torch.no_grad():
        for module_name, module in modules.items():
            # raises Unsupported for an input changed in place after the layer read it
            calls = layer_calls(module_name, records[module_name])
            if not calls:  # never called, or its output did not reach the loss
                continue
            for attribute, grads in rule_for(module).per_example(module, calls).items():
                result[(module_name, attribute)] = grads
    return result


def _check_sums(
    params: dict[str, torch.Tensor], position: dict[int, int], grads: list[Any], batch_grads: Any
) -> None:
    """Each parameter's per-example gradients must add up to its batch gradient.

    Allowed error: ``tolerance * sqrt(B * sum_i |g_i|^2)`` (a bound on the summation's rounding,
    as ``sum_i |g_i| <= sqrt(B sum_i |g_i|^2)``), plus the dtype's epsilon times the largest such
    scale of any parameter: a gradient that cancels to rounding noise (an attention key's bias,
    whose gradient is exactly zero) is compared at the scale of the whole model's gradients.
    """
    checks = []
    for name, leaf in params.items():
        per_example = grads[position[id(leaf)]]
        batch_grad = batch_grads[position[id(leaf)]]
        total = per_example.sum(0)
        want = torch.zeros_like(total) if batch_grad is None else batch_grad.detach()
        # sqrt(B sum_i |g_i|^2), without a B x P temporary of squares
        scale = math.sqrt(per_example.shape[0]) * torch.linalg.vector_norm(per_example)
        scale = scale + torch.linalg.vector_norm(want)
        checks.append((name, torch.linalg.vector_norm(total - want), scale, want.dtype))
    if not checks:
        return
    largest = max(float(scale) for _, _, scale, _ in checks)
    for name, error, scale, dtype in checks:
        tolerance = torch_checks.TOLERANCES["gradient_sum"].of(dtype)
        allowed = tolerance * scale + torch.finfo(dtype).eps * largest
        if error > allowed:
            raise Unsupported(
                f"the per-example gradients of {name!r} from the layer hooks do not add up to "
                f"its batch gradient: the parameter is used outside the forward pass of its layer"
            )


def listing(unsupported: dict[str, str]) -> str:
    return "; ".join(f"{k!r}: {v}" for k, v in unsupported.items())


def assess(request: GradsRequest, forced: bool) -> Assessment:
    """For a ``module_loss`` (the registry checks that): every parameter in a layer with a rule?"""
    spec = request.spec
    call = request.call
    params = call.backend.unflatten(call.treedefs[0], call.leaves[0])
    found = plan(spec, spec.fn, params)
    if found.unsupported:
        return Assessment("hooks", False, listing(found.unsupported))
    why = (
        "requested"
        if forced
        else "a module_loss whose every parameter is in a layer with a rule: one plain pass of "
        "the batch, ahead of vmap"
    )
    return Assessment("hooks", True, why, plan=found)


def run(request: GradsRequest, verdict: Assessment) -> Any:
    spec = request.spec
    try:
        losses, grads = value_and_grads(
            spec,
            request.call,
            verdict.plan,
            request.single,
            request.diff_values,
            request.batched_values,
            request.batch_size,
        )
    except Exception as err:
        if is_pergrad_error(err) or spec.strategy == "hooks":
            raise
        # The batch through the model failed (a model written for one example): under "auto"
        # that is a reason to loop, which checks that one example runs on its own.
        raise Unsupported(
            f"the batched pass failed: {vmap_failure(request.call.backend, err)}"
        ) from err
    spec.last_strategy = "hooks"
    return losses, tuple(grads)
