"""What a DP step on an FSDP2 model checks, and how the processes agree on it: the model at
construction (:func:`check_sharded_model`: what a step could not compute correctly is refused
by name) and each step's micro-batch (:func:`agreed_batch`, :func:`agree`). Split from
``fsdp.py``, which runs the step.

**Why every check is agreed.** Each process of an FSDP2 step joins FSDP's collectives (each
layer's all-gather, the reduce-scatter) in the same order. An error that one process alone
raises (its micro-batch is malformed, its loss fails on its targets, a rule refuses its
records) would leave the others waiting in the next collective until the process group's
timeout. So the step's local checks end in a collective of their own, where every process
learns whether another failed and all raise together: the process that failed its own error,
the others a :class:`~pergrad._src.errors.PergradValueError` naming that process and its error.
Three such points: before the first collective (:func:`agreed_batch`: the checks of the
micro-batch and of ``user_ids``, one all-gather, the one the user-level check made already),
after the per-example losses and after the norms (:func:`agree`: one all-reduce of one number
each; the first also carries whether some layer ran in low precision, which the step needed to
all-reduce anyway). The process group stays usable: a later step runs as if the failed one had
not been tried. What is not covered: an error raised inside the model's own forward pass on
one process only (FSDP gathers each layer's weights there, a collective pergrad does not run):
a batch whose structure, dtypes or number of dimensions differ from the other processes' is
refused before it, but a value a layer rejects (a token id past an embedding's size) is not
checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from pergrad._src.backends import backend_of
from pergrad._src.capture import torch_tied
from pergrad._src.capture.rules import layer_parameters, rule_for
from pergrad._src.capture.torch_generic import find_unit
from pergrad._src.capture.torch_plan import GENERIC, Ownership, ownership
from pergrad._src.dp.correlated import CorrelatedNoise
from pergrad._src.dp.noise import GaussianNoise, NoiseMechanism
from pergrad._src.dp.users import check_user_ids
from pergrad._src.errors import PergradTypeError, PergradValueError

#: what an FSDP2 model must be, in this version (the end of every refusal's message)
SHARDED_HINT = (
    "DPOptimizer on an FSDP2 model (fully_shard) takes, in this version, models whose "
    "trainable parameters belong to layers with a ghost rule (Linear, Conv1d/2d, Embedding, "
    "norm layers, ...), to modules that hold no fully_shard'ed module (a class token, a "
    "LayerScale's gamma: their per-example gradients formed, the module run alone over the "
    "examples) or, beside fully_shard'ed modules, parameters used row by row (x + pos_embed, "
    "cls_token.expand(B, -1, -1): their per-example gradients read off the forward pass), "
    "tied only where pergrad has a cross rule (an embedding and a linear head, two "
    "embeddings), on a 1-D mesh"
)


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
            f"{SHARDED_HINT}."
        )
    if mesh.ndim != 1:
        raise PergradValueError(
            f"{func_name}: the model is sharded over a {mesh.ndim}-D device mesh (HSDP?); {SHARDED_HINT}."
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
                f"ghost path: {problem}. {SHARDED_HINT}."
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
                f"rule for {pair}: their per-example gradients' inner products; {SHARDED_HINT}."
            )
    orphans = [name for name in trainable if name not in uses_of]
    rules.update(_unit_rules(func_name, model, orphans))
    return rules


def _unit_rules(func_name: str, model: nn.Module, orphans: list[str]) -> dict[str, str]:
    """Unit name -> ``"generic"`` for the generic units (``capture/torch_generic.find_unit``)
    that form the per-example gradients of the trainable parameters ``orphans``, which no
    layer with a rule uses (``fsdp_units.py``); refuses a parameter with no unit and a
    parameter used under two names. A unit that is, or holds, an FSDP2 module cannot run alone
    (FSDP's collectives would run inside ``vmap``): its parameters' per-example gradients are
    read off the forward pass where each use is row by row, and the step refuses any other use
    (``fsdp_broadcast.py``), which only the forward pass shows."""
    names_of: dict[int, list[str]] = {}
    for full, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(full)
    units: dict[str, str] = {}
    for name in orphans:
        owner = name.rpartition(".")[0]
        unit = find_unit(model, owner) if rule_for(model.get_submodule(owner)) is None else None
        if unit is None:
            raise PergradValueError(
                f"{func_name}: the trainable parameter(s) {[name]} belong to no layer with a "
                f"ghost rule, and no part of the model can form their per-example gradients "
                f"alone; {SHARDED_HINT}. Freeze them (requires_grad_(False)) or replace the "
                f"layer."
            )
        aliases = names_of[id(model.get_parameter(name))]
        if len(aliases) > 1:
            raise PergradValueError(
                f"{func_name}: parameter {name!r}, which no layer with a ghost rule uses, is "
                f"also the model's {aliases[1:]} (tied weights); {SHARDED_HINT}."
            )
        units[unit] = GENERIC
    return units


def agreed_batch(
    func_name: str,
    sharded: ShardedModel,
    inputs: list[Any],
    targets: list[Any],
    user_ids: Any,
    step_users: set[int] | None,
    refused: BaseException | None = None,
) -> tuple[int, Any]:
    """``(batch size, user_ids)`` of this process's micro-batch, after the checks that every
    process must pass alike, agreed before the step's first collective (one all-gather).

    Refused on every process: a micro-batch some process refused (``refused``, the caller's
    own refusal, e.g. of its ``user_ids``; model inputs with no tensor batched on axis 0;
    ``user_ids`` that ``dp/users.check_user_ids`` refuses), a micro-batch whose structure,
    leaf types, dtypes or numbers of dimensions differ from another process's (each process's
    batch size and other sizes are its own: sequences padded to another length pass), a step
    with ``user_ids`` on some processes only, and a user whose examples are on two processes
    (each part would be clipped to ``max_norm`` on its own). ``step_users``: the ids of this
    process's micro-batches of the step so far, this one's included. ``user_ids`` comes back
    checked (on the parameters' device), None at example level."""
    problem: BaseException | None = refused
    batch_size, mine = 0, None
    if problem is None:
        try:
            batch_size = _batch_size(func_name, inputs)
            if user_ids is not None:
                user_ids = _checked_user_ids(func_name, sharded, user_ids, batch_size)
                mine = sorted(set(user_ids.tolist()) if step_users is None else step_users)
        except (PergradTypeError, PergradValueError) as err:
            problem = err
    report = {
        "problem": None if problem is None else str(problem),
        "users": mine,
        "layout": _layout(inputs, targets),
    }
    gathered: list[Any] = [None] * dist.get_world_size(sharded.group)
    dist.all_gather_object(gathered, report, sharded.group)
    if problem is not None:
        raise problem
    failed = [rank for rank, seen in enumerate(gathered) if seen["problem"] is not None]
    if failed:
        raise PergradValueError(
            f"{func_name}: process {failed[0]} refused its micro-batch of this step, so every "
            f"process stops before the step's collectives: {gathered[failed[0]]['problem']}"
        )
    _check_same_layout(func_name, [seen["layout"] for seen in gathered])
    _check_users_apart(func_name, [seen["users"] for seen in gathered])
    return batch_size, user_ids


def agree(
    func_name: str, group: Any, problem: BaseException | None, device: Any, *flags: bool
) -> list[bool]:
    """Whether each of ``flags`` holds on some process of ``group``, after raising on every
    process if one of them met a ``problem`` (one all-reduce of ``1 + len(flags)`` numbers on
    ``device``; one all-gather more where some process failed, for its message). The process
    that failed raises its own ``problem``; the others a :class:`PergradValueError` that names
    it and its error."""
    values = torch.tensor([float(problem is not None), *map(float, flags)], device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    if values[0].item():
        said = None if problem is None else f"{type(problem).__name__}: {problem}"
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, said, group)
        if problem is not None:
            raise problem
        rank = next(rank for rank, message in enumerate(gathered) if message is not None)
        raise PergradValueError(
            f"{func_name}: process {rank} failed in this step, so every process stops here "
            f"(no process is left waiting in a collective): {gathered[rank]}"
        )
    return [bool(value) for value in values[1:].tolist()]


def _batch_size(func_name: str, inputs: list[Any]) -> int:
    tensors = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.dim()]
    if not tensors:
        raise PergradValueError(
            f"{func_name}: on an FSDP2 model, the model inputs must hold a tensor batched on "
            f"axis 0; got {[type(x).__name__ for x in inputs]}."
        )
    return tensors[0].shape[0]


def _checked_user_ids(func_name: str, sharded: ShardedModel, user_ids: Any, batch_size: int) -> Any:
    like = sharded.owners.model.get_parameter(sharded.trainable[0]).to_local()
    bk = backend_of(like, func_name, "user_ids")
    return check_user_ids(func_name, bk, user_ids, batch_size, like)


def _layout(inputs: list[Any], targets: list[Any]) -> dict[str, str]:
    """What every process's micro-batch must share: each leaf's place (``"model input 0"``,
    ``"target 1['mask']"``) and, for a tensor, its dtype and number of dimensions; for any
    other leaf its type. Sizes are left out: batch sizes differ, and so may padded lengths."""
    layout = {}
    for kind, trees in (("model input", inputs), ("target", targets)):
        for index, tree in enumerate(trees):
            for path, leaf in pytree.tree_flatten_with_path(tree)[0]:
                place = f"{kind} {index}{pytree.keystr(path)}"
                layout[place] = (
                    f"a {leaf.dim()}-d {leaf.dtype} tensor"
                    if isinstance(leaf, torch.Tensor)
                    else f"a {type(leaf).__name__}"
                )
    return layout


def _check_same_layout(func_name: str, layouts: list[dict[str, str]]) -> None:
    places = list(dict.fromkeys(place for layout in layouts for place in layout))
    for place in places:
        seen = [layout.get(place, "nothing") for layout in layouts]
        if len(set(seen)) == 1:
            continue
        ranks_of: dict[str, list[int]] = {}
        for rank, what in enumerate(seen):
            ranks_of.setdefault(what, []).append(rank)
        said = "; ".join(f"processes {ranks} pass {what}" for what, ranks in ranks_of.items())
        raise PergradValueError(
            f"{func_name}: the processes' micro-batches differ at {place}: {said}. On an FSDP2 "
            f"model every process passes a micro-batch of the same structure, dtypes and "
            f"numbers of dimensions (its own batch size; an empty batch as x[:0]), or the "
            f"model's collectives would not match."
        )


def _check_users_apart(func_name: str, gathered: list[Any]) -> None:
    """Refuses a step with user_ids on some processes only, and a user on two processes."""
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
