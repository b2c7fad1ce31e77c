"""``DPOptimizer`` on FSDP2 models whose bare parameters sit beside ``fully_shard``'ed modules:
timm's ViT keeps ``cls_token`` and ``pos_embed`` on the model itself, which holds the sharded
blocks. Their per-example gradients are read off the forward pass where each use is row by row
(``torch/fsdp_broadcast.py``); any other use is refused on every process.

The in-process tests (default suite) check the reading itself against a loop of single-example
gradients, on a model without FSDP. The gloo runs (slow: this file run as a script, ``python
test_fsdp_torch_root_params.py WORLD_SIZE RANK STORE OUT``, the harness of
``test_fsdp_torch.py``) compare the FSDP2 step with the single-process ``DPOptimizer`` on the
union of the processes' examples, and check the clip bound and the refusals.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="FSDP2 is PyTorch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from pergrad import dp  # noqa: E402

if not torch.distributed.is_available():
    pytest.skip("this PyTorch build has no torch.distributed", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (run as a script, too)
from test_fsdp_torch import (  # noqa: E402
    EXPECTED_BATCH_SIZE,
    NUM_EXAMPLES,
    assert_params_equal,
    batches,
    error_of,
    gathered,
    join_gloo,
    leave_gloo,
    run_workers,
    shard,
)
from test_fsdp_torch_more import (  # noqa: E402
    USER_SAMPLE_RATE,
    USERS,
    bf16_policy,
    float32_loss,
    of_rank,
    user_batches,
)

PATCHES, PATCH, WIDTH, CLASSES = 4, 6, 8, 5
MAX_NORM = 0.05  # below every example's gradient norm: every example is clipped
BOUND_EXAMPLES = 3  # single-example steps of the clip-bound check
# the parameters read off the forward pass
ROOT = ["cls_token", "pos_embed", "gamma"]


class Block(nn.Module):
    """A pre-norm MLP block: every parameter in a layer with a ghost rule."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TimmViT(nn.Module):
    """timm's ``VisionTransformer`` layout: the class token and the position embeddings on the
    model itself, used as its ``_pos_embed`` does, and a learnable scale of the model's own
    (``x * gamma``: a parameter with no leading axis)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch_embed = nn.Linear(PATCH, WIDTH)
        self.cls_token = nn.Parameter(0.5 * torch.randn(1, 1, WIDTH))
        self.pos_embed = nn.Parameter(0.5 * torch.randn(1, PATCHES + 1, WIDTH))
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(WIDTH)
        self.gamma = nn.Parameter(1.0 + 0.3 * torch.randn(WIDTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.pos_embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x) * self.gamma
        return self.head(x[:, 0] + x[:, 1:].mean(1))


class EveryUse(TimmViT):
    """Each recognised form: in place, the parameter first, ``expand_as``, ``broadcast_to``,
    ``torch.add`` with ``alpha``, a division, and a use inside a submodule it is passed to."""

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        rows = torch.zeros(x.shape[0], 1, WIDTH)
        cls = self.cls_token.expand_as(rows) + torch.broadcast_to(self.cls_token, rows.shape)
        x = torch.cat([cls, x], dim=1)
        x = self.pos_embed - x
        x += self.pos_embed
        return torch.add(x, self.pos_embed, alpha=0.5) / self.gamma


class RootLinear(nn.Module):
    """A weight of the model itself used through ``F.linear``, beside its sharded layer: not
    row by row."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Linear(PATCH, WIDTH)
        self.root_weight = nn.Parameter(torch.randn(CLASSES, WIDTH) / WIDTH**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.patch(x).mean(1), self.root_weight)


class ScaledPositions(TimmViT):
    """The position embeddings scaled by a buffer before they meet the batch
    (``p * position_scale``: elementwise, with no batch in the op; expanded to the batch
    there, a later ``sum`` would count it ``B`` times)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("position_scale", torch.full((1, 1, WIDTH), 0.5))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.pos_embed * self.position_scale


class HiddenUse(TimmViT):
    """The position embeddings added where torch functions are disabled (as compiled code
    would run it) while ``hide`` is set: a use the reading cannot see."""

    hide = True

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        if not self.hide:
            return super().embed(x)
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        with torch._C.DisableTorchFunction():
            return x + self.pos_embed


def make_images() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(NUM_EXAMPLES, PATCHES, PATCH, generator=generator)
    return x, torch.randint(0, CLASSES, (NUM_EXAMPLES,), generator=generator)


def sharded(model: nn.Module, policy: Any = None) -> nn.Module:
    """``model`` with each block and the root ``fully_shard``'ed."""
    options = {} if policy is None else {"mp_policy": policy}
    return shard(model, list(getattr(model, "blocks", [])), **options)


def vit_optimizer(model: nn.Module, loss_fn: Any = F.cross_entropy, **options: Any) -> Any:
    return dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=options.pop("lr", 0.5), momentum=0.9),
        model,
        loss_fn,
        max_norm=MAX_NORM,
        expected_batch_size=options.pop("expected_batch_size", EXPECTED_BATCH_SIZE),
        **options,
    )


USER_LEVEL = {"noise_multiplier": 0.0, "expected_batch_size": USER_SAMPLE_RATE * 6}


def hook_counts(model: nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]


# --- the worker -------------------------------------------------------------------------------


def worker(world_size: int, rank: int, store: str, out: str) -> None:
    join_gloo(world_size, rank, store)
    seen: dict[str, Any] = {}
    data = make_images()

    # float32: the norms' read-off gradients, the clipped sum through FSDP's backward pass
    model = sharded(TimmViT())
    hooks = hook_counts(model)
    optimizer = vit_optimizer(model, noise_multiplier=0.0, distributed=True)
    seen["stats"] = [optimizer.step(data[0][i], data[1][i]) for i in batches(world_size, rank)]
    seen["steps"] = gathered(model)
    seen["hooks as they were"] = hook_counts(model) == hooks
    seen["bound"] = single_example_norms(rank, data, None)

    # user level (each user's examples on one process): the users' norms take them too
    model = sharded(TimmViT())
    optimizer = vit_optimizer(model, **USER_LEVEL, distributed=True)
    for step in user_batches():
        mine = of_rank(step, world_size, rank)
        optimizer.step(data[0][mine], data[1][mine], user_ids=USERS[mine])
    seen["users"] = gathered(model)

    # mixed precision: the clipped sum from the records and the read-off gradients
    model = sharded(TimmViT(), bf16_policy())
    optimizer = vit_optimizer(model, float32_loss, noise_multiplier=0.0, distributed=True)
    for indices in batches(world_size, rank):
        optimizer.step(data[0][indices], data[1][indices])
    seen["mixed"] = gathered(model)
    seen["mixed bound"] = single_example_norms(rank, data, bf16_policy())

    seen.update(refusals(rank, data))
    leave_gloo(seen, out, rank)


def single_example_norms(rank: int, data: Any, policy: Any) -> list[tuple[float, float]]:
    """Single-example steps (rank 0's, the others empty): each clipped gradient's norm, read
    from ``.grad``, and the share of it the read-off parameters hold."""
    model = sharded(TimmViT(), policy)
    optimizer = vit_optimizer(
        model, float32_loss, lr=1.0, noise_multiplier=0.0, expected_batch_size=1, distributed=True
    )
    found = []
    for example in range(BOUND_EXAMPLES):
        rows = [example] if rank == 0 else []
        optimizer.step(data[0][rows], data[1][rows])
        squares = {
            n: (p.grad.full_tensor().double() ** 2).sum() for n, p in model.named_parameters()
        }
        norm = float(sum(squares.values()) ** 0.5)
        found.append((norm, float(sum(squares[n] for n in ROOT) ** 0.5) / norm))
    return found


def refusals(rank: int, data: Any) -> dict[str, Any]:
    """A use that is not row by row, and a use the reading cannot see (on rank 0 only): each
    step refused on every process, the model left as it was; then a step that runs."""
    seen: dict[str, Any] = {}
    rows = [2 * rank, 2 * rank + 1]
    for case, model in (("linear", RootLinear()), ("hidden", HiddenUse())):
        if case == "hidden":
            model.hide = rank == 0
        model = sharded(model) if case == "hidden" else shard(model, [model.patch])
        optimizer = vit_optimizer(model, noise_multiplier=0.0, distributed=True)
        before, hooks = gathered(model), hook_counts(model)
        seen[case] = error_of(functools.partial(optimizer.step, data[0][rows], data[1][rows]))
        gc.collect()
        after = gathered(model)
        seen[f"{case} left as it was"] = {
            "values": all(torch.equal(before[n], after[n]) for n in before),
            "no .grad": all(p.grad is None for p in model.parameters()),
            "hooks": hooks == hook_counts(model),
            "sharded": all(
                isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()
            ),
        }
    model.hide = False  # (the hidden use gone: the next step runs)
    seen["after"] = optimizer.step(data[0][rows], data[1][rows]).strategy
    return seen


# --- the tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> tuple[int, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("fsdp_root_params")
    return 2, run_workers(2, directory, transformer=False, script=__file__)


SLOW = pytest.mark.slow(reason="spawns 2 gloo processes: about 15 s")


def reference(
    loss_fn: Any = F.cross_entropy, users: bool = False
) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """The single-process DPOptimizer's steps over the union of the processes' examples."""
    model, (x, y) = TimmViT(), make_images()
    if users:
        optimizer = vit_optimizer(model, loss_fn, **USER_LEVEL)
        stats = [optimizer.step(x[i], y[i], user_ids=USERS[i]) for i in user_batches()]
    else:
        optimizer = vit_optimizer(model, loss_fn, noise_multiplier=0.0)
        stats = [optimizer.step(x[i], y[i]) for i in batches()]
    return stats, {name: p.detach().clone() for name, p in model.named_parameters()}


@SLOW
def test_parameters_beside_sharded_blocks_step_as_in_one_process(workers):
    world_size, seen = workers
    stats, expected = reference()
    assert {s.clip_fraction for s in stats if s.batch_size} == {1.0}  # every example clipped
    initial = {name: p.detach() for name, p in TimmViT().named_parameters()}
    for name in ROOT:  # (they moved: the comparison covers them)
        assert float((expected[name] - initial[name]).abs().max()) > 1e-3, name
    for rank in range(world_size):
        assert_params_equal(seen[rank]["steps"], expected)
        got = seen[rank]["stats"]
        assert {s.strategy for s in got} == {"ghost-fsdp"}
        assert [s.clip_fraction for s in got] == pytest.approx([s.clip_fraction for s in stats])
        assert seen[rank]["hooks as they were"]


@SLOW
def test_user_level_steps_as_in_one_process(workers):
    world_size, seen = workers
    _, expected = reference(users=True)
    initial = {name: p.detach() for name, p in TimmViT().named_parameters()}
    for name in ROOT:
        assert float((expected[name] - initial[name]).abs().max()) > 1e-3, name
    for rank in range(world_size):
        assert_params_equal(seen[rank]["users"], expected)


@SLOW
@pytest.mark.parametrize("case", ["bound", "mixed bound"])
def test_each_example_is_clipped_within_max_norm(workers, case):
    world_size, seen = workers
    for rank in range(world_size):
        found = seen[rank][case]
        assert len(found) == BOUND_EXAMPLES
        for norm, share in found:  # clipped, to float32 rounding
            assert MAX_NORM * (1 - 1e-3) < norm <= MAX_NORM * (1 + 1e-5), found
            assert share > 0.05, found  # (the read-off parameters count in it)


@SLOW
def test_mixed_precision_steps_as_in_one_process_to_bfloat16s_rounding(workers):
    world_size, seen = workers
    _, expected = reference(float32_loss)
    initial = {name: p.detach() for name, p in TimmViT().named_parameters()}
    for rank in range(world_size):
        for name, value in expected.items():
            moved = float((value - initial[name]).abs().max())
            got = seen[rank]["mixed"][name]
            torch.testing.assert_close(got, value, rtol=0, atol=0.05 * moved + 1e-4, msg=name)


@SLOW
def test_a_use_not_row_by_row_is_refused_on_every_process_by_name(workers):
    world_size, seen = workers
    for rank in range(world_size):
        got = seen[rank]["linear"]
        assert got.startswith("PergradValueError: DPOptimizer: on an FSDP2 model, ") and (
            "parameter 'root_weight' of the model itself (FSDPRootLinear)" in got
            and "holds the FSDP2 module(s) ['<root>', 'patch']" in got
            and "but the model used it in torch.nn.functional.linear" in got
            and "freeze them" in got
        ), got
        assert all(seen[rank]["linear left as it was"].values()), seen[rank]


@SLOW
def test_a_use_the_reading_cannot_see_is_refused_on_every_process(workers):
    world_size, seen = workers
    for rank in range(world_size):
        got = seen[rank]["hidden"]
        if rank:  # (only rank 0 hid the use: the others name it)
            assert "process 0 failed in this step" in got, got
        assert "'pos_embed'" in got and "do not add up to its batch gradient" in got, got
        assert all(seen[rank]["hidden left as it was"].values()), seen[rank]
        assert seen[rank]["after"] == "ghost-fsdp"


if __name__ == "__main__":
    world_size_arg, rank_arg, store_arg, out_arg = sys.argv[1:]
    worker(int(world_size_arg), int(rank_arg), store_arg, out_arg)


# --- in one process: the reading itself, on a model without FSDP ------------------------------


def read_off(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, list[str]]:
    """The read-off per-example gradients of the model's own parameters (the model taken as a
    unit beside sharded modules), and the problems noted."""
    from pergrad._src.torch import fsdp_broadcast

    targets: list[torch.Tensor] = []
    problems: list[str] = []
    with fsdp_broadcast.reading_uses({"": model}, len(x), targets, problems) as capture:
        losses = F.cross_entropy(model(x), y, reduction="none")
    if problems:
        return None, problems
    torch.autograd.grad(losses.sum(), targets, allow_unused=True)
    fsdp_broadcast.release(capture)
    return fsdp_broadcast.read_off(capture, "", len(x)), problems


@pytest.mark.parametrize("kind", [TimmViT, EveryUse])
def test_read_off_gradients_equal_the_loop_of_single_examples(kind):
    from _reference import torch_module_loop_grads

    model = kind()
    x, y = make_images()
    for size in (5, 1) if kind is TimmViT else (5,):
        grads, problems = read_off(model, x[:size], y[:size])
        assert not problems
        want = torch_module_loop_grads(model, F.cross_entropy, [x[:size]], [y[:size]])
        assert set(grads) == set(ROOT)
        for name, value in grads.items():
            assert value.shape == (size, *model.get_parameter(name).shape)
            torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-6)
    assert all(not p._backward_hooks for p in model.parameters())


@pytest.mark.parametrize(
    "kind, name, op",
    [
        (RootLinear, "root_weight", "torch.nn.functional.linear"),
        (ScaledPositions, "pos_embed", "torch.Tensor.mul"),
    ],
)
def test_a_use_not_row_by_row_is_noted_by_name_and_no_hook_is_left(kind, name, op):
    model = kind()
    x, y = make_images()
    _, problems = read_off(model, x, y)
    (problem,) = problems
    assert f"parameter {name!r} of the model itself ({kind.__name__})" in problem
    assert f"used it in {op}," in problem and "freeze them" in problem
    gc.collect()
    assert all(not p._backward_hooks for p in model.parameters())
    assert hook_counts(model) == [0] * len(list(model.modules()))


def test_the_hooks_go_with_the_capture_when_the_step_stops_before_the_gradients():
    """(Another process refused the step: this one's capture is dropped unread.)"""
    from pergrad._src.torch import fsdp_broadcast

    model = TimmViT()
    x, y = make_images()
    targets: list[torch.Tensor] = []
    with fsdp_broadcast.reading_uses({"": model}, len(x), targets, []) as capture:
        model(x)
    assert all(model.get_parameter(name)._backward_hooks for name in ROOT)
    del capture, targets
    gc.collect()
    assert all(not p._backward_hooks for p in model.parameters())


def test_a_use_the_reading_cannot_see_fails_the_sum_check():
    from pergrad._src.errors import Unsupported

    x, y = make_images()
    with pytest.raises(Unsupported, match="'pos_embed'.*do not add up to its batch gradient"):
        read_off(HiddenUse(), x, y)
