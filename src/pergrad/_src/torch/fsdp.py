"""DP-SGD on a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``): what
``DPOptimizer(distributed=True)`` runs when the model's parameters are DTensor shards.

Each process holds ``1/N`` of every parameter and its own examples. One step:

1. **Norms** (ghost, no gathered parameter kept): the model runs its own forward pass (FSDP
   gathers each layer's weights while the layer runs, then frees them) under the capture
   engine's hooks (``capture/torch_engine.capturing``), which keep each layer's inputs; one
   backward pass of the summed per-example losses, differentiating only the layers' outputs
   (``torch.autograd.grad``: no weight gradient is formed, so FSDP has nothing to
   reduce-scatter), fills each layer's output gradients. A process sees the whole layer's
   inputs and output gradients for its own examples, unsharded, so each layer's rule gives
   the complete per-example squared norms of its own examples without any communication.
   The pass differentiates only the outputs that no other output leads to (GPT-2's two
   embeddings'): the others' gradients arrive on the way, and nothing holds the LM head's
   logits through the pass, nor every layer's output gradient to its end; the losses leave
   the pass without its graph, whose hooks would hold every layer's inputs through step 2.
   The step's peak memory is the non-private FSDP2 step's (a 4-layer GPT-2, vocabulary 8192,
   on 2 and 4 processes: 1.01x, ``benchmarks/fsdp_memory.py``).
2. **Clipped sum** (Lee & Kifer 2021): a second forward pass and the ordinary ``backward()``
   of ``sum_i w_i loss_i``, ``w_i`` the clip weights; FSDP's own reduce-scatter then leaves in
   each process's ``.grad`` its shard of the sum over all processes' examples. FSDP averages
   over the ``N`` processes; the shard is multiplied by ``N`` (exact for a power of two). The
   ``.grad`` fields are emptied again: the sums belong to the step.
3. **Noise** (:func:`add_noise`): drawn once per step on rank 0, from rank 0's generator, one
   parameter at a time in the single-process order and at its full shape, and scattered
   shard by shard (``distribute_tensor``): the whole model's noise is the single-process
   run's from the same generator, bit for bit, and only rank 0's generator counts, as in the
   data-parallel path (``distributed.py``). Cost: one scatter of ``P`` numbers, and one
   parameter's full-size noise held at a time. Correlated noise (``pergrad.dp.toeplitz``,
   ``blt``): rank 0 scatters the step's standard-normal draws ``z`` the same way, and each
   process runs the mechanism's recursion on its own shards
   (:meth:`~pergrad._src.dp.correlated.CorrelatedNoise.add_draws`), keeping the state of its
   shards only (``1/N`` of it): the recursion is linear and acts on each coordinate alone
   across the steps, so each coordinate's noise is the single-process run's.

**Parameters without a ghost rule** (a ViT's class token and position embeddings, a
LayerScale's ``gamma``, a weight used through ``F.linear``): their generic unit (as in one
process, ``capture/torch_generic.py``) is hooked in the norm pass, its parameters cloned at its
call (FSDP frees them after), and run alone over this process's examples after the backward
pass (``fsdp_units.py``); a unit that is, or holds, an FSDP2 module (timm's ``pos_embed`` and
``cls_token`` on the root) is not run: its parameters' gradients are read off the forward pass
where each use is row by row (``fsdp_broadcast.py``). Their ``(B, *shape)`` per-example
gradients, complete on each process, add their squared norms (formed in float32: exact as a
materialised gradient's) to each example's; the weighted backward pass covers their clipped
sum, and from the records each process adds ``sum_i w_i g_i`` of them, all-reduced like the
others. Tied weights (GPT-2's embedding as its output projection, both layers in one FSDP
group) add the cross terms of
``capture/torch_tied.py`` to their norms. **Mixed precision**
(``MixedPrecisionPolicy`` with a low ``param_dtype`` or ``reduce_dtype``, or ``torch.autocast``):
a bfloat16 backward pass would round each weighted gradient after its norm was bounded, so step
2 becomes each layer rule's weighted sum of the norm pass's records in float32 (as the
single-process ghost strategy), all-reduced one parameter at a time, each process keeping its
shard: each example stays within ``max_norm`` to float32 rounding, for one parameter's full-size
sum held at a time and twice FSDP's communication. **User-level DP** (``user_ids``): users'
norms from their examples' records side by side (``capture/torch_users.py``), each example
weighted by its user's clip factor; one all-gather of the step's ids first refuses a user on
two processes (its parts would be clipped apart).

**A failure on one process** (a malformed micro-batch, a loss that fails on its targets, a
rule that refuses its records, out of memory in the norms) is raised on every process, before
the next collective that would leave the others waiting: the checks are agreed at three points
of the step (``fsdp_checks.py``: before the first collective, between the norm pass's forward
and backward passes, after the norms), for one all-reduce of one number per micro-batch more
than the step needs anyway; the model is left as it was and the next step runs normally.

What this slice refuses (:func:`check_sharded_model`, with the reason): a parameter outside
every layer with a ghost rule, whose unit is or holds an FSDP2 module, used other than row by
row (``F.linear`` on a weight of the root), a unit that mixes the examples or whose output is
not batched on axis 0 (these at the step, on every process), a tie
between layers with no cross rule, a parameter left out of every ``fully_shard``, a 2-D (HSDP)
mesh, a noise mechanism other than independent Gaussian noise and the correlated noise of
:mod:`pergrad._src.dp.correlated` (a mechanism of one's own has no recursion to run shard by
shard), a custom ``set_gradient_divide_factor``, and a user on two processes in one step.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from pergrad._src.api.reductions import global_norms
from pergrad._src.backends import backend_of
from pergrad._src.capture.rules import layer_parameters, rule_for
from pergrad._src.capture.torch_engine import capturing, layer_calls, per_example_losses
from pergrad._src.capture.torch_plan import GENERIC
from pergrad._src.capture.torch_quantities import (
    LeafSquaredNorms,
    add_formed_sums,
    add_layer_sums,
    layer_squared_norms,
    squared_norms,
    weighted_calls,
)
from pergrad._src.capture.torch_session import CapturedPass, when_complete
from pergrad._src.capture.torch_users import UserRows, user_squared_norms
from pergrad._src.core.module_loss import ModuleLoss
from pergrad._src.dp.clipping import ClipWeights, clip_statistics, clip_weights
from pergrad._src.dp.clipping_policies import ClippingPolicy
from pergrad._src.dp.from_loss import ClippedRun
from pergrad._src.dp.users import user_slots
from pergrad._src.errors import PergradValueError, Unsupported
from pergrad._src.strategies.protocol import StrategyChoice
from pergrad._src.torch.fsdp_checks import SHARDED_HINT, ShardedModel, agree, agreed_batch
from pergrad._src.torch.fsdp_checks import check_sharded_model as check_sharded_model
from pergrad._src.torch.fsdp_units import UnitCapture, capturing_units, formed_gradients

#: the strategy name :class:`pergrad.dp.DPStep` reports for a step on an FSDP2 model
STRATEGY = "ghost-fsdp"
_REASON = (
    "the model is sharded with FSDP2: ghost norms from each layer's inputs and output "
    "gradients, the clipped sum from a weighted backward pass through FSDP's reduce-scatter"
)
_REASON_RECORDS = (
    "the model is sharded with FSDP2 and runs in mixed precision: ghost norms from each "
    "layer's inputs and output gradients, the clipped sum from the same records in float32, "
    "all-reduced"
)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` has a parameter that is a DTensor (FSDP2's ``fully_shard``)."""
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is None:  # no DTensor exists before its module is imported (saves that)
        return False
    return any(isinstance(p, tensor_module.DTensor) for p in model.parameters())


def clipped_sum_run(
    sharded: ShardedModel,
    loss: ModuleLoss,
    batch: tuple[Any, ...],
    *,
    max_norm: float,
    clipping: ClippingPolicy | None,
    user_ids: Any = None,
    step_users: set[int] | None = None,
    refused: BaseException | None = None,
) -> ClippedRun:
    """This process's examples (or users) clipped, summed over every process into each one's
    shards.

    ``batch``: the model inputs then the loss function's targets, each batched on axis 0.
    ``user_ids``: None (example level) or ``(B,)`` user ids; ``step_users``: the ids of this
    process's micro-batches of the step so far, this one's included (checked apart from every
    other process's); ``refused``: the caller's refusal of this micro-batch (raised on every
    process, ``fsdp_checks.agreed_batch``). Returns the
    :class:`~pergrad._src.dp.from_loss.ClippedRun` of ``clipped_sum_run``: ``clipped.sum``
    maps each trainable parameter's name to its shard (a DTensor like the parameter) of the
    clipped sum over ALL processes' examples; ``norms``, ``clip_fraction``, ``count`` and
    ``nonfinite`` are this process's examples' (users'). Collective: every process of the mesh
    calls it, each with its own examples (an empty batch included); an error on one process
    before the weighted pass is raised on all (``fsdp_checks.py``)."""
    func_name = "DPOptimizer"
    autocast = _autocast_enabled()
    if autocast:
        # FSDP's unsharded parameters are the same tensors from step to step: autocast would
        # reuse its cached low-precision copies of the last step's values within one region
        torch.clear_autocast_cache()
    inputs, targets = list(batch[: loss.num_inputs]), list(batch[loss.num_inputs :])
    # (each check agreed across the processes: fsdp_checks.py's docstring)
    batch_size, user_ids = agreed_batch(
        func_name, sharded, inputs, targets, user_ids, step_users, refused
    )
    # Low memory: each layer's norms in the backward pass as its output gradients arrive,
    # which are then dropped (the clipped sum comes from a second, weighted backward pass).
    # Not where the sum must come from the records (low precision) or the norms need them
    # all (users' norms).
    low_memory = user_ids is None and sharded.low_precision is None and not autocast
    low_precision = sharded.low_precision is not None or autocast
    losses, session, computed, from_records, units, missed = _norm_pass(
        sharded, loss, inputs, targets, batch_size, low_memory, low_precision
    )
    problem: Exception | None = None
    try:  # (a layer whose norms failed in the backward pass fails here again)
        if missed:  # (never seen: _backward_targets's reasoning failed; no norm is left out)
            raise PergradValueError(
                f"{func_name}: on an FSDP2 model, the norm pass's backward pass did not reach "
                f"the outputs of layers {missed}, which lead to the loss: their norms are not "
                f"known, and the step is refused. Please report this, with the model."
            )
        dtypes = {name: session.params[name].dtype for name in session.params}
        session.unit_grads = formed_gradients(session.owners, units, batch_size, dtypes)
        del units  # (the units' records and parameters' clones)
        squared = _squared_norms(session, user_ids, computed)
    except Unsupported as err:  # no fallback here: the chunked strategy cannot take DTensors
        problem = PergradValueError(f"{func_name}: on an FSDP2 model, {err}; {SHARDED_HINT}.")
        problem.__cause__ = err
    except Exception as err:  # (e.g. out of memory on this process alone)
        problem = err
    agree(func_name, sharded.group, problem, losses.device)  # (before the weighted pass)
    bk = backend_of(losses, func_name, "losses")
    uppers = [e if b is None else e + b for e, b in zip(squared, squared.bounds)]
    norms = global_norms(list(squared))
    weights, per_example = _clip_weights(bk, global_norms(uppers), max_norm, clipping, user_ids)
    if from_records:
        with torch.no_grad():  # (the records are activations of the graph)
            summed = _records_sum(sharded, session, per_example)
    else:
        del session  # (its records: the weighted backward pass makes its own)
        summed = _weighted_backward(sharded, loss, inputs, targets, batch_size, per_example)
    clipped = clip_statistics(bk, summed, [norms], [max_norm], weights)
    rules = {name: rule_for(layer).name for name, layer in sharded.owners.modules.items()}
    rules.update(dict.fromkeys(sharded.owners.units, GENERIC))
    choice = StrategyChoice(STRATEGY, _REASON_RECORDS if from_records else _REASON, None, rules)
    return ClippedRun(clipped, choice, STRATEGY, losses.detach())


def _autocast_enabled() -> bool:
    return torch.is_autocast_enabled("cpu") or (
        torch.cuda.is_available() and torch.is_autocast_enabled("cuda")
    )


def _clip_weights(
    bk: Any, upper_norms: torch.Tensor, max_norm: float, clipping: Any, user_ids: Any
) -> tuple[ClipWeights, torch.Tensor]:
    """The clip weights (per example, or per user in the row of its first example,
    ``dp/users.user_slots``) and each example's weight (its user's)."""
    if user_ids is None:
        weights = clip_weights(bk, [upper_norms], [max_norm], None, clipping)
        return weights, weights.weights[0]
    groups = user_slots(bk, user_ids, None, upper_norms.new_ones(()))
    weights = clip_weights(bk, [upper_norms], [max_norm], groups.real, clipping)
    return weights, (weights.weights[0][:, None] * groups.slots).sum(0)


def _targets_dims(targets: list[Any], batch_size: int) -> list[Any]:
    """``vmap`` dims of the loss function's arguments: 0 for a tensor batched on axis 0."""
    return [
        pytree.tree_map(
            lambda x: (
                0 if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch_size else None
            ),
            target,
        )
        for target in targets
    ]


def _losses(
    loss: ModuleLoss, inputs: list[Any], targets: list[Any], batch_size: int
) -> torch.Tensor:
    """``(B,)`` per-example losses through the model's own forward pass (FSDP's hooks gather
    each layer's parameters as it runs)."""
    return _row_losses(loss, loss.forward(None, inputs), targets, batch_size)


def _row_losses(loss: ModuleLoss, output: Any, targets: list[Any], batch_size: int) -> torch.Tensor:
    """``(B,)`` per-example losses of the model's ``output`` (no collective)."""
    # per_example_losses reads only the caller's name from the spec
    spec: Any = types.SimpleNamespace(func_name="DPOptimizer")
    dims = _targets_dims(targets, batch_size)
    return per_example_losses(spec, loss, output, targets, dims, batch_size)


def _norm_pass(
    sharded: ShardedModel,
    loss: ModuleLoss,
    inputs: list[Any],
    targets: list[Any],
    batch_size: int,
    low_memory: bool,
    low_precision: bool,
) -> tuple[torch.Tensor, CapturedPass, dict[str, dict[str, Any]], bool, UnitCapture, list[str]]:
    """The per-example losses (detached), every layer's records, output gradients filled, as a
    :class:`~pergrad._src.capture.torch_session.CapturedPass` whose parameters are stand-ins
    (the reductions read their names, shapes and dtypes only; the rules read the records), the
    norms computed in the pass, whether the clipped sum comes from the records
    (``low_precision`` on some process, or some layer's output below float32 on one), and the
    generic units' calls and parameters (``fsdp_units.py``), their output gradients filled,
    and the layers whose calls the backward pass should have reached and did not (none: the
    caller raises otherwise).

    Between the forward and the backward pass, which both run FSDP's collectives, the
    processes agree (``fsdp_checks.agree``, one all-reduce) on whether the per-example losses
    failed on one of them and on where the sum comes from. ``low_memory`` (unless from the
    records): each layer's norms as soon as its output gradients are in (each layer that
    shares no parameter), which are then dropped; a rule that fails there, in the backward
    pass, is met again by the caller after the pass. The backward pass differentiates only
    the outputs the others lead to (:func:`_backward_targets`)."""
    owners = sharded.owners
    computed: dict[str, dict[str, Any]] = {}
    device = _device(sharded)
    with torch.enable_grad():
        with (
            capturing(owners.modules, batch_size) as records,
            capturing_units(owners.units, batch_size) as units,
        ):
            output = loss.forward(None, inputs)
            try:
                losses = _row_losses(loss, output, targets, batch_size)
                problem = None
            except Exception as err:  # the user's loss_fn on this process's targets
                losses, problem = None, err
            del output
        outputs = [r.output for rs in records.values() for r in rs if r.hooked] + units.targets
        low = any(x.is_floating_point() and x.element_size() < 4 for x in outputs)
        if problem is None and units.problems:
            problem = PergradValueError(
                f"DPOptimizer: on an FSDP2 model, {'; '.join(units.problems)}; {SHARDED_HINT}."
            )
        try:
            (from_records,) = agree(
                "DPOptimizer", sharded.group, problem, device, low_precision or low
            )
        except Exception:
            _reshard(owners.model)  # (the root keeps its gathered weights after a forward pass)
            raise
        assert losses is not None
        if low_memory and not from_records:
            unshared = {n: m for n, m in owners.modules.items() if n not in owners.sharing}
            when_complete(unshared, records, functools.partial(_norms_in_hook, computed))
        del outputs
        total = losses.sum()
        grad_targets, reached_through = _backward_targets(total, records, units.targets)
        if grad_targets:
            # outputs only: no weight gradient, so FSDP reduce-scatters nothing. Run on an
            # empty batch too: FSDP gathers each layer's weights again in this pass, a
            # collective every process must join.
            torch.autograd.grad(total, grad_targets, allow_unused=True)
        del total, grad_targets
        units.targets.clear()
    # without its graph: the output hooks on the graph's nodes hold the records (every
    # layer's inputs), which would stay alive through the weighted pass
    losses = losses.detach()
    missed = sorted(
        {
            name
            for name, record in reached_through
            if record.output_grad is None and name not in computed
        }
    )
    for layer_records in records.values():
        for record in layer_records:
            record.output = None
    params = {}
    for name in sharded.trainable:  # a 0-d zero expanded: no memory of the parameter's size
        param = owners.model.get_parameter(name)
        params[name] = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
    session = CapturedPass(
        diff=list(params.values()),
        params=params,
        owners=owners,
        batch_size=batch_size,
        records=records,
        unit_records={},
        bias_records={},
        losses=None,
        light=[],
        rng=None,
        loss_values=losses,
    )
    return losses, session, computed, from_records, units, missed


def _backward_targets(
    total: torch.Tensor, records: dict[str, list[Any]], unit_targets: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[tuple[str, Any]]]:
    """What the norm pass differentiates ``total`` (the summed losses) with respect to, and
    the recorded calls it reaches on the way, whose outputs the records let go of now.

    Differentiating a tensor runs every backward node on a path from the loss to it, and a
    recorded output's hook fires when its node runs: an output whose node leads to another
    target's node gets its gradient on the way, without being a target. It is then neither
    held by its record through the pass (an LM head's logits, ``B x T x vocabulary`` numbers,
    which autograd itself does not keep) nor has its gradient returned and held to the end of
    the pass (each target's is). The targets: the generic units' outputs, the recorded outputs
    changed in place since their call (their hook is on the node before the change), those
    the loss does not reach (as before: their gradient is None), and those whose node leads to
    no other target's (for a GPT-2: the two embeddings' outputs). The engine runs the same
    nodes as with every output a target. Returns the targets and ``(layer name, record)`` of
    each call reached on the way (the caller checks that each got its gradient)."""
    hooked = [(name, r) for name, rs in records.items() for r in rs if r.hooked]
    for _, record in hooked:
        record.light_input = None  # (the input stays in record.inputs)
    ends = {x.grad_fn for x in unit_targets if x.grad_fn is not None}
    ends |= {r.output.grad_fn for _, r in hooked if r.output.grad_fn is not None}
    leads_on = _leads_to(total.grad_fn, ends)
    reached = [
        (name, r)
        for name, r in hooked
        if r.output._version == r.output_version and leads_on.get(r.output.grad_fn, False)
    ]
    del ends, leads_on  # (the graph's nodes: the graph is the losses' to free)
    targets = list(unit_targets)
    reached_ids = {id(r) for _, r in reached}
    targets += [r.output for _, r in hooked if id(r) not in reached_ids]
    for _, record in reached:
        record.output = None
    return targets, reached


def _leads_to(root: Any, ends: set[Any]) -> dict[Any, bool]:
    """For each backward node reachable from ``root``: whether one of its ``next_functions``,
    or a node further down, is in ``ends``. One depth-first walk of the graph, without
    recursion (a deep model's graph is deep). The nodes are the keys (hashed by identity,
    held while the dictionary lives)."""
    leads: dict[Any, bool] = {}
    if root is None:
        return leads
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if node in leads:
            continue
        children = [child for child, _ in node.next_functions if child is not None]
        if children_done:
            leads[node] = any(c in ends or leads.get(c, False) for c in children)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in children if c not in leads)
    return leads


def _device(sharded: ShardedModel) -> Any:
    """The device of the parameters' shards (that of the process group's collectives)."""
    return sharded.owners.model.get_parameter(sharded.trainable[0]).device


def _reshard(model: nn.Module) -> None:
    """Every FSDP module of ``model`` back to its shards (after a forward pass with no
    backward pass: the model's parameters are its DTensors again)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _norms_in_hook(
    computed: dict[str, dict[str, Any]], name: str, layer: nn.Module, records: list[Any]
) -> bool:
    """``when_complete``'s callback: the layer's norms into ``computed`` (True: its output
    gradients may go), unless one is below float32 (False: kept). (An error raised here is
    met again after the pass, by ``squared_norms``, where the processes agree on it.)"""
    grads = [r.output_grad for r in records if r.output_grad is not None]
    if any(g.is_floating_point() and g.element_size() < 4 for g in grads):
        return False
    computed[name] = layer_squared_norms(layer, layer_calls(name, records))
    return True


def _squared_norms(
    session: CapturedPass, user_ids: Any, computed: dict[str, dict[str, Any]]
) -> LeafSquaredNorms:
    """Each trainable parameter's ``(B,)`` squared norms (per example, tied parameters'
    cross terms included; or per user, in the row of the user's first example) and their
    rounding bounds."""
    if session.batch_size == 0:  # (the rules reshape by the batch size)
        empty = [leaf.new_zeros(0) for leaf in session.diff]
        return LeafSquaredNorms(empty, [None] * len(empty))
    if user_ids is None:
        return squared_norms(session, computed)
    return user_squared_norms(session, UserRows(user_ids, None))


def _weighted_backward(
    sharded: ShardedModel,
    loss: ModuleLoss,
    inputs: list[Any],
    targets: list[Any],
    batch_size: int,
    weights: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The gradient of ``sum_i w_i loss_i``, reduce-scattered by FSDP: each trainable
    parameter's shard of the sum over every process's examples. The parameters' ``.grad``
    are None before and after (the step empties them first)."""
    keep = weights > 0
    if not bool(keep.all()):
        # an example of weight 0 (its gradient is not finite) must add exactly nothing, and
        # its nan would reach the others' sums through the weight gradients (0 * nan is nan):
        # it is left out of this pass
        inputs, targets = _rows(inputs, keep, batch_size), _rows(targets, keep, batch_size)
        weights, batch_size = weights[keep], int(keep.sum())
    with torch.enable_grad():
        losses = _losses(loss, inputs, targets, batch_size)
        weighted = losses * weights.detach().to(losses.dtype)
        # every process runs the backward pass, an empty batch too: FSDP's reduce-scatter is
        # collective
        weighted.sum().backward()
    summed = {}
    for full in sharded.trainable:
        param = sharded.owners.model.get_parameter(full)
        grad = param.grad
        param.grad = None
        summed[full] = torch.zeros_like(param) if grad is None else grad.mul_(sharded.world_size)
    return summed


def _records_sum(
    sharded: ShardedModel, session: CapturedPass, weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``sum_i w_i g_i`` over every process's examples, each trainable parameter's shard (a
    DTensor like it, in ``trainable`` order): layer by layer, the rule's weighted sum of this
    process's records in float32 (examples of weight 0 cleaned first, ``weighted_calls``),
    the layer's records freed, and each parameter's sum all-reduced whole and cut to this
    process's shard; a tied parameter's once its every use is added, after the other layers;
    the generic units' parameters' from their formed per-example gradients, last.
    Collective: every process reduces the same parameters in the same order."""
    owners = session.owners
    groups = [(weights, list(range(len(session.diff))))]
    tied: dict[str, torch.Tensor] = {}
    summed = {}
    for module_name, module in owners.modules.items():
        records, session.records[module_name] = session.records[module_name], []
        calls = layer_calls(module_name, records) if session.batch_size else []
        del records
        values: list[Any] = [None] * len(session.diff)
        if calls:
            add_layer_sums(session, module_name, module, calls, groups, weighted_calls, values)
        del calls
        for relative, _ in layer_parameters(module):
            name = owners.name_in_params(module_name, relative)
            if name is None:  # frozen
                continue
            value = values[session.index_of(name)]
            if value is None:  # no call reached the loss (or no example here): zeros
                value = session.params[name].new_zeros(session.params[name].shape)
            if name in owners.tied:
                tied[name] = tied[name] + value if name in tied else value
            else:
                summed[name] = _reduced_shard(sharded, name, value)
    for name, value in tied.items():
        summed[name] = _reduced_shard(sharded, name, value)
    if owners.units:  # the formed per-example gradients' sums (fsdp_units.py)
        values = [None] * len(session.diff)
        add_formed_sums(session, groups, values)
        session.unit_grads = {}
        for names in owners.unit_parameters.values():
            for name in names.values():
                value = values[session.index_of(name)]
                if value is None:  # (no example here, or the unit did not reach the loss)
                    value = session.params[name].new_zeros(session.params[name].shape)
                summed[name] = _reduced_shard(sharded, name, value)
    return {name: summed[name] for name in sharded.trainable}


def _reduced_shard(sharded: ShardedModel, name: str, full: torch.Tensor) -> Any:
    """This process's shard (a DTensor like parameter ``name``) of the sum over the
    processes of ``full``, each one's full-size value (one all-reduce)."""
    from torch.distributed.tensor import DTensor, Replicate

    param = sharded.owners.model.get_parameter(name)
    if full.dtype != param.dtype:  # a sum rounded to the passes' precision: not bounded
        raise PergradValueError(
            f"DPOptimizer: the clipped sum of parameter {name!r} came out in {full.dtype}, "
            f"not in its shard's {param.dtype}; this mixed-precision layout is not supported."
        )
    full = full.contiguous()
    dist.all_reduce(full, group=sharded.group)
    mesh = param.device_mesh
    whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    local = whole.redistribute(mesh, param.placements).to_local().clone()
    if local.shape != param.to_local().shape:
        raise PergradValueError(
            f"DPOptimizer: parameter {name!r}'s shard has shape {tuple(param.to_local().shape)} "
            f"but its clipped sum's shard has {tuple(local.shape)}; this FSDP layout is not "
            f"supported yet."
        )
    return DTensor.from_local(
        local, mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
    )


def _rows(trees: list[Any], keep: torch.Tensor, batch_size: int) -> list[Any]:
    """The rows ``keep`` of every tensor batched on axis 0 in ``trees``; the rest as is."""
    return pytree.tree_map(
        lambda x: (
            x[keep] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch_size else x
        ),
        trees,
    )
