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

What this slice refuses (:func:`check_sharded_model`, with the reason): a parameter outside
every layer with a ghost rule (no per-example gradients formed shard by shard yet), tied
weights (their cross terms), FSDP mixed precision (``MixedPrecisionPolicy(param_dtype=...)``)
and ``torch.autocast`` (the weighted backward pass rounds each example's gradient in the low
precision, so its norm could exceed the bound the norms were clipped to), a parameter left out
of every ``fully_shard``, a 2-D (HSDP) mesh, a noise mechanism other than independent
Gaussian noise and the correlated noise of :mod:`pergrad._src.dp.correlated` (a mechanism
of one's own has no recursion to run shard by shard), and a custom
``set_gradient_divide_factor``.
"""

from __future__ import annotations

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
from pergrad._src.capture import cost
from pergrad._src.capture.rules import layer_parameters, rule_for
from pergrad._src.capture.torch_engine import capturing, layer_calls, per_example_losses
from pergrad._src.capture.torch_quantities import layer_squared_norms
from pergrad._src.core.module_loss import ModuleLoss
from pergrad._src.dp.clipping import clip_statistics, clip_weights
from pergrad._src.dp.clipping_policies import ClippingPolicy
from pergrad._src.dp.correlated import CorrelatedNoise
from pergrad._src.dp.from_loss import ClippedRun
from pergrad._src.dp.noise import GaussianNoise, NoiseMechanism, add_independent_gaussian
from pergrad._src.errors import PergradValueError, Unsupported
from pergrad._src.strategies.protocol import StrategyChoice

#: the strategy name :class:`pergrad.dp.DPStep` reports for a step on an FSDP2 model
STRATEGY = "ghost-fsdp"
_REASON = (
    "the model is sharded with FSDP2: ghost norms from each layer's inputs and output "
    "gradients, the clipped sum from a weighted backward pass through FSDP's reduce-scatter"
)
_HINT = (
    "DPOptimizer on an FSDP2 model (fully_shard) takes, in this version, models whose "
    "trainable parameters all belong to layers with a ghost rule (Linear, Conv1d/2d, "
    "Embedding, norm layers, ...), untied, in float32, on a 1-D mesh"
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
      layers: module name -> module, every layer that owns a trainable parameter (each with a
        ghost rule); its hooks record its calls.
      owned: module name -> {parameter name relative to the layer: full name}, the trainable
        parameters each layer's rule reduces.
      world_size: the number of processes the parameters are sharded over (FSDP averages
        their gradients over this many).
      trainable: the trainable parameters' full names, in ``named_parameters`` order (the
        single-process order of the clipped sum and of its noise draws).
    """

    layers: dict[str, nn.Module]
    owned: dict[str, dict[str, str]]
    world_size: int
    trainable: tuple[str, ...]


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
    for module_name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            _check_fsdp_settings(func_name, module_name or "<root>", module)
    layers, owned = _layers_owning(func_name, model, trainable)
    world_size = 1 if mesh is None else mesh.size()
    return ShardedModel(layers, owned, world_size, tuple(trainable))


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


def _check_fsdp_settings(func_name: str, name: str, module: Any) -> None:
    """FSDP settings that would change the clipped sum: mixed precision and a custom divide
    factor. Read from FSDP's state (no public getter); absent attributes pass."""
    state = module._get_fsdp_state()
    for param_group in getattr(state, "_fsdp_param_groups", ()):
        policy = getattr(param_group, "mp_policy", None)
        param_dtype = getattr(policy, "param_dtype", None)
        reduce_dtype = getattr(policy, "reduce_dtype", None)
        if any(d is not None and d != torch.float32 for d in (param_dtype, reduce_dtype)):
            raise PergradValueError(
                f"{func_name}: module {name!r} is sharded with FSDP mixed precision "
                f"(param_dtype={param_dtype}, reduce_dtype={reduce_dtype}), not supported yet: "
                f"the clipped sum is a backward pass, which would round each example's "
                f"gradient in the low precision after its norm was bounded, so a clipped "
                f"gradient could exceed max_norm. Shard in float32 (no mp_policy)."
            )
        if getattr(param_group, "gradient_divide_factor", None) is not None:
            raise PergradValueError(
                f"{func_name}: module {name!r} has a custom gradient divide factor "
                f"(set_gradient_divide_factor); DPOptimizer sums the clipped gradients with "
                f"FSDP's reduce-scatter and undoes its default averaging. Leave it unset."
            )


def _layers_owning(
    func_name: str, model: nn.Module, trainable: dict[str, torch.Tensor]
) -> tuple[dict[str, nn.Module], dict[str, dict[str, str]]]:
    """Each layer with a ghost rule that owns a trainable parameter, and those parameters;
    refuses a trainable parameter no such layer owns, and a parameter used by two layers."""
    by_id = {id(p): name for name, p in trainable.items()}
    layers: dict[str, nn.Module] = {}
    owned: dict[str, dict[str, str]] = {}
    owners_of: dict[str, list[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        rule = rule_for(module)
        if rule is None:
            continue
        own = {relative: by_id[id(p)] for relative, p in layer_parameters(module) if id(p) in by_id}
        if not own:
            continue
        problem = rule.problem(module)
        if problem is not None:
            raise PergradValueError(
                f"{func_name}: layer {module_name!r} ({type(module).__name__}) cannot take the "
                f"ghost path: {problem}. {_HINT}."
            )
        layers[module_name], owned[module_name] = module, own
        for full in own.values():
            owners_of.setdefault(full, []).append(module_name)
    tied = {name: users for name, users in owners_of.items() if len(users) > 1}
    if tied:
        name, users = next(iter(tied.items()))
        raise PergradValueError(
            f"{func_name}: parameter {name!r} is used by layers {users} (tied weights), not "
            f"supported on an FSDP2 model yet; {_HINT}."
        )
    orphans = [name for name in trainable if name not in owners_of]
    if orphans:
        raise PergradValueError(
            f"{func_name}: the trainable parameter(s) {orphans} belong to no layer with a "
            f"ghost rule, and per-example gradients are not formed shard by shard yet; {_HINT}. "
            f"Freeze them (requires_grad_(False)) or replace the layer."
        )
    return layers, owned


def clipped_sum_run(
    sharded: ShardedModel,
    loss: ModuleLoss,
    batch: tuple[Any, ...],
    *,
    max_norm: float,
    clipping: ClippingPolicy | None,
) -> ClippedRun:
    """This process's examples clipped, summed over every process into each one's shards.

    ``batch``: the model inputs then the loss function's targets, each batched on axis 0.
    Returns the :class:`~pergrad._src.dp.from_loss.ClippedRun` of ``clipped_sum_run``:
    ``clipped.sum`` maps each trainable parameter's name to its shard (a DTensor like the
    parameter) of the clipped sum over ALL processes' examples; ``norms``, ``clip_fraction``,
    ``count`` and ``nonfinite`` are this process's examples'. Collective: every process of
    the mesh calls it, each with its own examples (an empty batch included)."""
    func_name = "DPOptimizer"
    if torch.is_autocast_enabled("cpu") or (
        torch.cuda.is_available() and torch.is_autocast_enabled("cuda")
    ):
        raise PergradValueError(
            f"{func_name}: torch.autocast on an FSDP2 model is not supported yet: the clipped "
            f"sum is a backward pass, which would round each example's gradient in the low "
            f"precision after its norm was bounded. Step outside autocast."
        )
    inputs, targets = list(batch[: loss.num_inputs]), list(batch[loss.num_inputs :])
    batch_size = _batch_size(func_name, inputs)
    try:
        losses, records = _norm_pass(sharded, loss, inputs, targets, batch_size)
        estimates, uppers = _squared_norms(sharded, records, losses, batch_size)
    except Unsupported as err:  # no fallback here: the chunked strategy cannot take DTensors
        raise PergradValueError(f"{func_name}: on an FSDP2 model, {err}; {_HINT}.") from err
    del records
    bk = backend_of(losses, func_name, "losses")
    norms = global_norms(estimates)
    weights = clip_weights(bk, [global_norms(uppers)], [max_norm], None, clipping)
    summed = _weighted_backward(sharded, loss, inputs, targets, batch_size, weights.weights[0])
    clipped = clip_statistics(bk, summed, [norms], [max_norm], weights)
    rules = {name: rule_for(layer).name for name, layer in sharded.layers.items()}
    choice = StrategyChoice(STRATEGY, _REASON, None, rules)
    return ClippedRun(clipped, choice, STRATEGY, losses.detach())


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
) -> tuple[torch.Tensor, dict[str, list[Any]]]:
    """The per-example losses and every layer's records, output gradients filled."""
    with torch.enable_grad():
        with capturing(sharded.layers, batch_size) as records:
            losses = _losses(loss, inputs, targets, batch_size)
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
    return losses, records


def _squared_norms(
    sharded: ShardedModel,
    records: dict[str, list[Any]],
    losses: torch.Tensor,
    batch_size: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each trainable parameter's ``(B,)`` squared norms (estimates), and their upper bounds
    (estimate + rounding bound, what clip weights are formed from)."""
    estimates: list[torch.Tensor] = []
    uppers: list[torch.Tensor] = []
    layers = sharded.layers if batch_size else {}  # (the rules reshape by the batch size)
    for module_name, module in layers.items():
        calls = layer_calls(module_name, records[module_name])
        if not calls:  # its output did not reach the loss: zero gradients
            continue
        with torch.no_grad():
            values = layer_squared_norms(module, calls)
        for relative in sharded.owned[module_name]:
            estimate, bound = cost.split(values[relative])
            estimates.append(estimate)
            uppers.append(estimate if bound is None else estimate + bound)
    if not estimates:
        zeros = losses.detach().new_zeros(batch_size)
        return [zeros], [zeros]
    return estimates, uppers


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
    by_name = {
        full: layer.get_parameter(relative)
        for name, layer in sharded.layers.items()
        for relative, full in sharded.owned[name].items()
    }
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
        param = by_name[full]
        grad = param.grad
        param.grad = None
        summed[full] = torch.zeros_like(param) if grad is None else grad.mul_(sharded.world_size)
    return summed


def _rows(trees: list[Any], keep: torch.Tensor, batch_size: int) -> list[Any]:
    """The rows ``keep`` of every tensor batched on axis 0 in ``trees``; the rest as is."""
    return pytree.tree_map(
        lambda x: (
            x[keep] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch_size else x
        ),
        trees,
    )


def add_noise(
    summed: dict[str, torch.Tensor],
    std: float,
    generator: Any,
    noise: NoiseMechanism,
    state: Any,
) -> tuple[dict[str, Any], Any]:
    """``(summed plus the step's noise, in place; the mechanism's next state)``.

    ``summed``: each parameter's DTensor shard of the clipped sum, in the single-process
    order. Independent Gaussian noise: ``std * z`` drawn on rank 0 of the parameters' mesh
    from its ``generator`` (the other ranks' are not used), at each parameter's full shape in
    ``summed``'s order, and scattered shard by shard. Correlated noise: ``z`` drawn and
    scattered the same way, and the mechanism's recursion run on this process's shards;
    ``state`` (None at the first step) holds its buffers for these shards only. Collective;
    a step past the mechanism's run is refused on every process before the noise's scatter."""
    if isinstance(noise, CorrelatedNoise):
        return _add_correlated(summed, std, generator, noise, state)
    for name, shard in summed.items():

        def scaled_draw(full: torch.Tensor, name: str = name) -> torch.Tensor:
            return add_independent_gaussian({name: full}, std, generator, owned=True)[name]

        shard.to_local().add_(_scattered(name, shard, scaled_draw))
    return summed, state


def _add_correlated(
    summed: dict[str, Any], std: float, generator: Any, noise: CorrelatedNoise, state: Any
) -> tuple[dict[str, Any], Any]:
    shards = {name: shard.to_local() for name, shard in summed.items()}
    if state is None:
        state = noise.init(shards)
    names = list(summed)

    def draw(index: int, local: torch.Tensor) -> torch.Tensor:
        name = names[index]
        # (the draw is rank 0's, then scattered: the backend's draw, as add() would make it)
        bk = backend_of(local, "DPOptimizer", "noise")
        return _scattered(name, summed[name], lambda full: bk.standard_normal(generator, full))

    _, state = noise.add_draws(shards, draw, std, state, owned=True)
    return summed, state


def _scattered(name: str, shard: Any, fill: Any) -> torch.Tensor:
    """This process's shard (a local tensor shaped like ``shard``'s) of ``fill(zeros)``,
    computed on rank 0 of the mesh at the parameter's full shape and scattered."""
    from torch.distributed.tensor import distribute_tensor

    mesh, local = shard.device_mesh, shard.to_local()
    full = torch.zeros(shard.shape, dtype=shard.dtype, device=local.device)
    if mesh.get_local_rank() == 0:  # distribute_tensor scatters mesh rank 0's values
        full = fill(full)
    values = distribute_tensor(full, mesh, shard.placements).to_local()
    del full
    if values.shape != local.shape:
        raise PergradValueError(
            f"DPOptimizer: parameter {name!r}'s shard has shape {tuple(local.shape)} but "
            f"distribute_tensor gives its noise the shape {tuple(values.shape)}; this FSDP "
            f"layout is not supported yet."
        )
    return values
