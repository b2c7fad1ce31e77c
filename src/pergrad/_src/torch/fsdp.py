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

Tied weights (GPT-2's embedding as its output projection, both layers in one FSDP group) add
the cross terms of ``capture/torch_tied.py`` to their norms. **Mixed precision**
(``MixedPrecisionPolicy`` with a low ``param_dtype`` or ``reduce_dtype``, or ``torch.autocast``):
a bfloat16 backward pass would round each weighted gradient after its norm was bounded, so step
2 becomes each layer rule's weighted sum of the norm pass's records in float32 (as the
single-process ghost strategy), all-reduced one parameter at a time, each process keeping its
shard: each example stays within ``max_norm`` to float32 rounding, for one parameter's full-size
sum held at a time and twice FSDP's communication. **User-level DP** (``user_ids``): users'
norms from their examples' records side by side (``capture/torch_users.py``), each example
weighted by its user's clip factor; one all-gather of the step's ids first refuses a user on
two processes (its parts would be clipped apart).

What this slice refuses (:func:`check_sharded_model`, with the reason): a parameter outside
every layer with a ghost rule (no per-example gradients formed shard by shard yet), a tie
between layers with no cross rule, a parameter left out of every ``fully_shard``, a 2-D (HSDP)
mesh, a noise mechanism other than independent Gaussian noise and the correlated noise of
:mod:`pergrad._src.dp.correlated` (a mechanism of one's own has no recursion to run shard by
shard), a custom ``set_gradient_divide_factor``, and a user on two processes in one step.
"""

from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from pergrad._src.api.reductions import global_norms
from pergrad._src.backends import backend_of
from pergrad._src.capture import torch_tied
from pergrad._src.capture.rules import layer_parameters, rule_for
from pergrad._src.capture.torch_engine import capturing, layer_calls, per_example_losses
from pergrad._src.capture.torch_plan import Ownership, ownership
from pergrad._src.capture.torch_quantities import (
    LeafSquaredNorms,
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
from pergrad._src.dp.correlated import CorrelatedNoise
from pergrad._src.dp.from_loss import ClippedRun
from pergrad._src.dp.noise import GaussianNoise, NoiseMechanism
from pergrad._src.dp.users import check_user_ids, user_slots
from pergrad._src.errors import PergradTypeError, PergradValueError, Unsupported
from pergrad._src.strategies.protocol import StrategyChoice

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
_HINT = (
    "DPOptimizer on an FSDP2 model (fully_shard) takes, in this version, models whose "
    "trainable parameters all belong to layers with a ghost rule (Linear, Conv1d/2d, "
    "Embedding, norm layers, ...), tied only where pergrad has a cross rule (an embedding "
    "and a linear head, two embeddings), on a 1-D mesh"
)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` has a parameter that is a DTensor (FSDP2's ``fully_shard``)."""
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is None:  # no DTensor exists before its module is imported (saves that)
        return False
    return any(isinstance(p, tensor_module.DTensor) for p in model.parameters())


@dataclass(frozen=True)
class ShardedModel:
    """What a step on an FSDP2 model needs to know, found once at construction.

    Attributes:
      owners: which layer (with a ghost rule) reduces each trainable parameter
        (``torch_plan.Ownership``: the hooked layers, the tied parameters); the names are
        those of ``named_parameters``.
      world_size: the number of processes the parameters are sharded over (FSDP averages
        their gradients over this many).
      trainable: the trainable parameters' full names, in ``named_parameters`` order (the
        single-process order of the clipped sum and of its noise draws).
      group: the process group of the parameters' mesh.
      low_precision: a module sharded with a low-precision ``MixedPrecisionPolicy`` (its
        name), or None: the clipped sum is then formed from the records (module docstring).
    """

    owners: Ownership
    world_size: int
    trainable: tuple[str, ...]
    group: Any
    low_precision: str | None


def check_sharded_model(
    func_name: str, model: nn.Module, group: Any, noise: NoiseMechanism
) -> ShardedModel:
    """The layers of an FSDP2 ``model`` and its mesh, after the checks that refuse (with a
    :class:`PergradValueError` naming the problem) what a step could not compute correctly."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if group is None:
        raise PergradValueError(
            f"{func_name}: the model is sharded with FSDP2 (its parameters are DTensors); pass "
            f"distributed=True (or the process group of its mesh): the clipped sum and the "
            f"noise are shared across the processes."
        )
    if not isinstance(noise, (GaussianNoise, CorrelatedNoise)):
        raise PergradValueError(
            f"{func_name}: noise={noise!r} on an FSDP2 model is not supported: each process "
            f"adds the noise of its own shards, which pergrad knows how to split for its own "
            f"mechanisms only (pergrad.dp.gaussian(), toeplitz(), blt(), optimal_blt())."
        )
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    meshes = {}
    for name, param in trainable.items():
        if not isinstance(param, DTensor):
            raise PergradValueError(
                f"{func_name}: parameter {name!r} is not sharded by fully_shard (a plain "
                f"tensor in a model whose other parameters are DTensors): FSDP would not "
                f"reduce its gradient across processes. Call fully_shard on the root module "
                f"too."
            )
        meshes[name] = param.device_mesh
    mesh = next(iter(meshes.values()), None)
    if mesh is not None:
        _check_mesh(func_name, mesh, meshes, group)
    low_precision = None
    for module_name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            name = module_name or "<root>"
            if _check_fsdp_settings(func_name, name, module) and low_precision is None:
                low_precision = name
    owners = ownership(model, trainable, _layer_rules(func_name, model, trainable))
    world_size = 1 if mesh is None else mesh.size()
    return ShardedModel(owners, world_size, tuple(trainable), group, low_precision)


def _check_mesh(func_name: str, mesh: Any, meshes: dict[str, Any], group: Any) -> None:
    if any(other != mesh for other in meshes.values()):
        raise PergradValueError(
            f"{func_name}: the model's parameters are sharded over different device meshes; "
            f"{_HINT}."
        )
    if mesh.ndim != 1:
        raise PergradValueError(
            f"{func_name}: the model is sharded over a {mesh.ndim}-D device mesh (HSDP?); {_HINT}."
        )
    mesh_ranks = dist.get_process_group_ranks(mesh.get_group())
    group_ranks = dist.get_process_group_ranks(group)
    if sorted(mesh_ranks) != sorted(group_ranks):
        raise PergradValueError(
            f"{func_name}: the model is sharded over the processes {sorted(mesh_ranks)} (its "
            f"device mesh), but distributed= names the group of {sorted(group_ranks)}; pass "
            f"the mesh's process group (mesh.get_group())."
        )


def _check_fsdp_settings(func_name: str, name: str, module: Any) -> bool:
    """Whether ``module`` is sharded with a low-precision ``MixedPrecisionPolicy``, after
    refusing a custom divide factor (the weighted backward pass undoes FSDP's default
    averaging). Read from FSDP's state (no public getter); absent attributes pass."""
    state = module._get_fsdp_state()
    low_precision = False
    for param_group in getattr(state, "_fsdp_param_groups", ()):
        policy = getattr(param_group, "mp_policy", None)
        dtypes = (getattr(policy, "param_dtype", None), getattr(policy, "reduce_dtype", None))
        low_precision |= any(d is not None and d != torch.float32 for d in dtypes)
        if getattr(param_group, "gradient_divide_factor", None) is not None:
            raise PergradValueError(
                f"{func_name}: module {name!r} has a custom gradient divide factor "
                f"(set_gradient_divide_factor); DPOptimizer sums the clipped gradients with "
                f"FSDP's reduce-scatter and undoes its default averaging. Leave it unset."
            )
    return low_precision


def _layer_rules(
    func_name: str, model: nn.Module, trainable: dict[str, torch.Tensor]
) -> dict[str, str]:
    """Module name -> rule name of each layer with a ghost rule that uses a trainable
    parameter; refuses a trainable parameter no such layer uses, and a parameter two layers
    share without a cross rule for their pair (``capture/torch_tied.py``)."""
    by_id = {id(p): name for name, p in trainable.items()}
    rules: dict[str, str] = {}
    uses_of: dict[str, list[tuple[str, str, str]]] = {}  # name -> (layer, family, attribute)
    seen: set[int] = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        rule = rule_for(module)
        if rule is None or id(module) in seen:
            continue
        seen.add(id(module))
        own = {relative: by_id[id(p)] for relative, p in layer_parameters(module) if id(p) in by_id}
        if not own:
            continue
        problem = rule.problem(module)
        if problem is not None:
            raise PergradValueError(
                f"{func_name}: layer {module_name!r} ({type(module).__name__}) cannot take the "
                f"ghost path: {problem}. {_HINT}."
            )
        rules[module_name] = rule.name
        for relative, full in own.items():
            uses_of.setdefault(full, []).append((module_name, rule.name, relative))
    for name, uses in uses_of.items():
        pair = torch_tied.missing_cross([(family, attribute) for _, family, attribute in uses])
        if len(uses) > 1 and pair is not None:
            raise PergradValueError(
                f"{func_name}: parameter {name!r} is used by layers "
                f"{[layer for layer, _, _ in uses]} (tied weights), and pergrad has no cross "
                f"rule for {pair}: their per-example gradients' inner products; {_HINT}."
            )
    orphans = [name for name in trainable if name not in uses_of]
    if orphans:
        raise PergradValueError(
            f"{func_name}: the trainable parameter(s) {orphans} belong to no layer with a "
            f"ghost rule, and per-example gradients are not formed shard by shard yet; {_HINT}. "
            f"Freeze them (requires_grad_(False)) or replace the layer."
        )
    return rules


def clipped_sum_run(
    sharded: ShardedModel,
    loss: ModuleLoss,
    batch: tuple[Any, ...],
    *,
    max_norm: float,
    clipping: ClippingPolicy | None,
    user_ids: Any = None,
    step_users: set[int] | None = None,
) -> ClippedRun:
    """This process's examples (or users) clipped, summed over every process into each one's
    shards.

    ``batch``: the model inputs then the loss function's targets, each batched on axis 0.
    ``user_ids``: None (example level) or ``(B,)`` user ids; ``step_users``: the ids of this
    process's micro-batches of the step so far, this one's included (checked apart from every
    other process's). Returns the :class:`~pergrad._src.dp.from_loss.ClippedRun` of
    ``clipped_sum_run``: ``clipped.sum`` maps each trainable parameter's name to its shard (a
    DTensor like the parameter) of the clipped sum over ALL processes' examples; ``norms``,
    ``clip_fraction``, ``count`` and ``nonfinite`` are this process's examples' (users').
    Collective: every process of the mesh calls it, each with its own examples (an empty batch
    included)."""
    func_name = "DPOptimizer"
    autocast = _autocast_enabled()
    if autocast:
        # FSDP's unsharded parameters are the same tensors from step to step: autocast would
        # reuse its cached low-precision copies of the last step's values within one region
        torch.clear_autocast_cache()
    inputs, targets = list(batch[: loss.num_inputs]), list(batch[loss.num_inputs :])
    batch_size = _batch_size(func_name, inputs)
    user_ids = _checked_user_ids(func_name, sharded, user_ids, step_users, batch_size)
    # Low memory: each layer's norms in the backward pass as its output gradients arrive,
    # which are then dropped (the clipped sum comes from a second, weighted backward pass).
    # Not where the sum must come from the records (low precision) or the norms need them
    # all (users' norms).
    low_memory = user_ids is None and sharded.low_precision is None and not autocast
    losses, session, computed = _norm_pass(sharded, loss, inputs, targets, batch_size, low_memory)
    from_records = _any_process(
        sharded.group,
        sharded.low_precision is not None or autocast or _low_precision(session),
        losses.device,
    )
    if from_records and low_memory:  # a cast no setting showed: the pass again, records kept
        del session
        losses, session, computed = _norm_pass(sharded, loss, inputs, targets, batch_size, False)
    bk = backend_of(losses, func_name, "losses")
    try:
        squared = _squared_norms(session, user_ids, computed)
    except Unsupported as err:  # no fallback here: the chunked strategy cannot take DTensors
        raise PergradValueError(f"{func_name}: on an FSDP2 model, {err}; {_HINT}.") from err
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
    choice = StrategyChoice(STRATEGY, _REASON_RECORDS if from_records else _REASON, None, rules)
    return ClippedRun(clipped, choice, STRATEGY, losses.detach())


def _autocast_enabled() -> bool:
    return torch.is_autocast_enabled("cpu") or (
        torch.cuda.is_available() and torch.is_autocast_enabled("cuda")
    )


def _low_precision(session: CapturedPass) -> bool:
    """Whether some layer ran in a precision below float32 (its output gradients), however
    it came to (a policy or a cast this module's checks did not see)."""
    grads = [r.output_grad for rs in session.records.values() for r in rs]
    return any(g is not None and g.is_floating_point() and g.element_size() < 4 for g in grads)


def _any_process(group: Any, flag: bool, device: Any) -> bool:
    """Whether ``flag`` holds on some process of ``group`` (one all-reduce of one number on
    ``device``, the losses'), so that every process takes the same collectives."""
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


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


def _checked_user_ids(
    func_name: str, sharded: ShardedModel, user_ids: Any, step_users: Any, batch_size: int
) -> Any:
    """``user_ids`` checked (``dp/users.check_user_ids``, on the parameters' device), None at
    example level. Refuses, on every process alike (one all-gather, before the step's other
    collectives), a user whose examples are on two processes in one step (each part would be
    clipped to ``max_norm`` on its own), a step with ``user_ids`` on some processes and
    without on others, and ``user_ids`` that some process refused."""
    problem = mine = None
    if user_ids is not None:
        like = sharded.owners.model.get_parameter(sharded.trainable[0]).to_local()
        try:
            bk = backend_of(like, func_name, "user_ids")
            user_ids = check_user_ids(func_name, bk, user_ids, batch_size, like)
            mine = sorted(set(user_ids.tolist()) if step_users is None else step_users)
        except (PergradTypeError, PergradValueError) as err:
            problem, mine = err, str(err)
    gathered: list[Any] = [None] * dist.get_world_size(sharded.group)
    dist.all_gather_object(gathered, mine, sharded.group)
    if problem is not None:
        raise problem
    refused = [rank for rank, ids in enumerate(gathered) if isinstance(ids, str)]
    if refused:
        raise PergradValueError(
            f"{func_name}: user_ids: process {refused[0]} refused its step: {gathered[refused[0]]}"
        )
    if len({ids is None for ids in gathered}) > 1:
        without = [rank for rank, ids in enumerate(gathered) if ids is None]
        raise PergradValueError(
            f"{func_name}: user_ids: the processes {without} stepped without user_ids and the "
            f"others with them; on an FSDP2 model every process passes user_ids= at every "
            f"step of a user-level run (an empty tensor with an empty batch)."
        )
    processes_of: dict[int, list[int]] = {}
    for rank, ids in enumerate(gathered):
        for user in ids or ():
            processes_of.setdefault(user, []).append(rank)
    shared = sorted(user for user, ranks in processes_of.items() if len(ranks) > 1)
    if shared:
        ranks = sorted({rank for user in shared for rank in processes_of[user]})
        raise PergradValueError(
            f"{func_name}: user_ids: user(s) {shared[:5]} are in the batches of processes "
            f"{ranks} in this step; each user's examples must all be on one process (each "
            f"part would be clipped to max_norm on its own). Send each sampled user to one "
            f"process, e.g. by user_id % world_size."
        )
    return user_ids


def _batch_size(func_name: str, inputs: list[Any]) -> int:
    tensors = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim()]
    if not tensors:
        raise PergradValueError(
            f"{func_name}: on an FSDP2 model, the model inputs must hold a tensor batched on "
            f"axis 0; got {[type(x).__name__ for x in inputs]}."
        )
    return tensors[0].shape[0]


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
    output = loss.forward(None, inputs)
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
) -> tuple[torch.Tensor, CapturedPass, dict[str, dict[str, Any]]]:
    """The per-example losses, every layer's records, output gradients filled, as a
    :class:`~pergrad._src.capture.torch_session.CapturedPass` whose parameters are stand-ins
    (the reductions read their names, shapes and dtypes only; the rules read the records), and
    the norms computed in the pass (``low_memory``: each layer that shares no parameter, as
    soon as its output gradients are in, which are then dropped; a layer whose gradients are
    in a precision below float32 keeps them, for the caller to see)."""
    owners = sharded.owners
    computed: dict[str, dict[str, Any]] = {}
    with torch.enable_grad():
        with capturing(owners.modules, batch_size) as records:
            losses = _losses(loss, inputs, targets, batch_size)
        if low_memory:
            unshared = {n: m for n, m in owners.modules.items() if n not in owners.sharing}
            when_complete(unshared, records, functools.partial(_norms_in_hook, computed))
        outputs = [r.output for rs in records.values() for r in rs if r.hooked]
        for layer_records in records.values():
            for record in layer_records:
                record.light_input = None
        if outputs:
            # the outputs only: no weight gradient, so FSDP reduce-scatters nothing. Run on
            # an empty batch too: FSDP gathers each layer's weights again in this pass, a
            # collective every process must join.
            torch.autograd.grad(losses.sum(), outputs, allow_unused=True)
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
        loss_values=losses.detach(),
    )
    return losses, session, computed


def _norms_in_hook(
    computed: dict[str, dict[str, Any]], name: str, layer: nn.Module, records: list[Any]
) -> bool:
    """``when_complete``'s callback: the layer's norms into ``computed`` (True: its output
    gradients may go), unless one is below float32 (False: kept)."""
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
    process's shard; a tied parameter's once its every use is added, after the other layers.
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
