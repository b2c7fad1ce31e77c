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
  step's work), as the ghost strategy does; where ``params`` are the model's own (as
  ``loss.params()`` gives), those calls run the model on them, without ``functional_call``;
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
from typing import Any

import torch
from torch import nn

from pergrad._src.capture import torch_checks
from pergrad._src.capture.rules import full_float32, rule_for
from pergrad._src.capture.torch_engine import (
    capturing,
    layer_calls,
    model_and_loss_arguments,
    per_example_losses,
)
from pergrad._src.core.call import Call, Spec
from pergrad._src.core.module_loss import ModuleLoss, refuse_batch_mixing_layers
from pergrad._src.errors import PergradValueError, Unsupported, is_pergrad_error
from pergrad._src.strategies.hooks_plan import HooksPlan, own_parameters, plan, views_of
from pergrad._src.strategies.protocol import Assessment, GradsRequest
from pergrad._src.strategies.vmap import vmap_failure

_LOSS_CHECKS = 64  # examples whose loss alone is compared on the first call


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
    modules = hooks_plan.layers
    diff = [x.detach().requires_grad_(True) for x in diff_values]
    args = call.rebuild(diff, batched_values)
    params = args[0]
    inputs, targets, target_dims = model_and_loss_arguments(call, args, loss.num_inputs, batch_size)
    rng = call.backend.rng_state()
    arguments = (spec, loss, params, diff, modules, inputs, targets, target_dims, batch_size)
    try:
        if verify or not _light_on_own_parameters(loss, hooks_plan, params):
            losses, records, batch_grads = _forward_backward(*arguments, verify, observe)
        else:
            try:
                losses, records, batch_grads = _light_forward_backward_own(*arguments, observe)
            except _ChangedInPlace:
                _CHANGED_IN_PLACE.add(loss)
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
    output_hooks: bool = True,
) -> tuple[Any, Any, list[Any] | None]:
    """Forward the batch with the layers hooked, then ``backward(sum of losses, retain,
    records)`` -> batch gradients (or None: only the layers' outputs were differentiated);
    with ``verify`` (and two examples or more), a second, weighted backward pass checks that
    each layer's output gradient is row-local. The backward passes stay inside the hooks:
    reentrant checkpointing reruns the forward pass there. ``output_hooks``: as
    ``capturing``'s (False: ``backward`` hands the records their output gradients)."""
    row_checks = verify and batch_size > 1
    with torch.enable_grad(), capturing(modules, batch_size, output_hooks) as records:
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


# Losses whose light pass found a hooked layer's output changed in place (its own
# parameters could then not be left out of the backward pass): functional_call for them.
_CHANGED_IN_PLACE: weakref.WeakSet[ModuleLoss] = weakref.WeakSet()


class _ChangedInPlace(Exception):
    """A light pass on the model's own parameters met an output changed in place."""


def _light_on_own_parameters(
    loss: ModuleLoss, hooks_plan: HooksPlan, params: dict[str, torch.Tensor]
) -> bool:
    """Whether a light pass (a checked layout: only the hooked layers' outputs are
    differentiated) may run the model on its own parameters instead of ``functional_call``
    (0.1-0.3 ms a call on the bench transformer, 2-5% of its batch gradient, to swap the
    parameters in and out): ``params`` are views of them (as ``loss.params()`` gives), each
    of which requires grad (so every layer output that ``params`` reach is differentiable the
    same way), and no earlier light pass of ``loss`` met an output changed in place (which
    needs the parameters' own gradients: they must be fresh leaves, or the user's hooks on
    the parameters would fire)."""
    return loss not in _CHANGED_IN_PLACE and views_of(
        params, hooks_plan.parameters, requiring_grad=True
    )


def _light_forward_backward_own(
    spec: Spec,
    loss: ModuleLoss,
    params: dict[str, torch.Tensor],
    diff: list[torch.Tensor],
    modules: dict[str, nn.Module],
    inputs: tuple[Any, ...],
    targets: list[Any],
    target_dims: list[Any],
    batch_size: int,
    observe: Callable[[dict[str, list[Any]], int], None] | None,
) -> tuple[Any, Any, None]:
    """A light pass through the model's own parameters (:func:`_light_on_own_parameters`):
    only the hooked layers' outputs are differentiated (``torch.autograd.grad``: no
    ``.grad`` is written, no hook on a parameter is reached), and their gradients handed to
    the records as ``torch.autograd.grad`` returns them (no tensor hook: 10 us a layer).
    Raises :class:`_ChangedInPlace` where an output was changed in place since its layer
    returned it (a tensor hook would see the gradient of the value the layer returned; the
    returned gradient is that of the value changed), or is a leaf."""

    def backward(total: torch.Tensor, retain: bool, records: Any) -> None:
        outputs = None if _unfit_for_own_pass(records) else _outputs(records)
        if outputs is None:
            raise _ChangedInPlace
        grads = torch.autograd.grad(total, outputs, allow_unused=True, retain_graph=retain)
        by_output = {id(output): grad for output, grad in zip(outputs, grads)}
        for layer_records in records.values():
            for record in layer_records:
                # (a record of the forward pass that checkpointing reran inside the backward
                # pass was not differentiated: its tensor hook would not have fired either)
                grad = None if record.output is None else by_output.get(id(record.output))
                if grad is not None:
                    record.receive(grad.movedim(record.output_axis, 0))

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
        False,
        observe,
        output_hooks=False,
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


def _unfit_for_own_pass(records: dict[str, list[Any]]) -> bool:
    """Whether an in-place op has changed a hooked call's recorded output since its layer
    returned it, or one is a leaf (a layer returning a parameter of its own: differentiating
    it would reach the user's hooks on that parameter)."""
    return any(
        r.output is not None and (r.output._version != r.output_version or r.output.is_leaf)
        for layer_records in records.values()
        for r in layer_records
    )


def _gather(
    modules: dict[str, nn.Module], records: dict[str, list[Any]]
) -> dict[tuple[str, str], torch.Tensor]:
    """``(module_name, attribute) -> (B, *shape)`` from each layer's rule.

    The rules run in full float32 (``rules.full_float32``), each rule call for itself; set
    once around them all, the flags are set once a call instead of once a layer (each rule
    call then finds them set: about 5 us a layer less)."""
    result = {}
    with torch.no_grad(), full_float32():
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
