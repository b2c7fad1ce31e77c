"""``DPOptimizer`` on FSDP2 models with parameters no layer rule owns (a ViT's class token and
position embeddings, a LayerScale's ``gamma``, a weight used through ``F.linear``): their
per-example gradients formed by running their module alone (``torch/fsdp_units.py``).

The harness of ``test_fsdp_torch.py``: this file, run as a script (``python
test_fsdp_torch_units.py WORLD_SIZE RANK STORE OUT``), plays each scenario on gloo processes and
saves what it saw; the tests compare that with the single-process ``DPOptimizer`` on the union
of the processes' examples, computed here (its own route: the ghost strategy's generic units or
the per-example gradients formed whole, as its cost model picks).
"""

from __future__ import annotations

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
    NOISE_MULTIPLIER,
    NOISE_SEED,
    NUM_EXAMPLES,
    assert_params_equal,
    batches,
    error_of,
    gathered,
    join_gloo,
    leave_gloo,
    noise_step,
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


class Embeddings(nn.Module):
    """A ViT's patch embedding: a linear patch projection, then a class token and position
    embeddings (bare parameters beside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(PATCH, WIDTH)
        self.cls_token = nn.Parameter(0.5 * torch.randn(1, 1, WIDTH))
        self.pos_embed = nn.Parameter(0.5 * torch.randn(1, PATCHES + 1, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x)
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed


class LayerScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(0.5 + 0.1 * torch.randn(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class BareLinear(nn.Module):
    """A weight used through ``F.linear`` by a module of its own: no layer rule."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(fan_out, fan_in) / fan_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ViTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = BareLinear(2 * WIDTH, WIDTH)
        self.scale = LayerScale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale(self.down(F.gelu(self.up(self.norm(x)))))


class TinyViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embeddings = Embeddings()
        self.blocks = nn.ModuleList([ViTBlock(), ViTBlock()])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


class RootPositions(nn.Module):
    """timm's layout: the position embeddings on the model itself, beside its layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Linear(PATCH, WIDTH)
        self.pos_embed = nn.Parameter(torch.zeros(1, PATCHES, WIDTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((self.patch(x) + self.pos_embed).mean(1))


class Centered(nn.Module):
    """A scale applied after subtracting the batch mean: it mixes the examples, so run alone
    on one example it does not reproduce that example's row."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) * self.weight


class Mixing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Linear(PATCH, WIDTH)
        self.center = Centered()
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.center(self.patch(x)).mean(1))


def make_vit(policy: Any = None) -> nn.Module:
    """The ViT, sharded (each block and the root) where ``policy`` is not None or a process
    group exists."""
    model = TinyViT()
    if torch.distributed.is_initialized():
        options = {} if policy is None else {"mp_policy": policy}
        shard(model, list(model.blocks), **options)
    return model


def make_images() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(NUM_EXAMPLES, PATCHES, PATCH, generator=generator)
    return x, torch.randint(0, CLASSES, (NUM_EXAMPLES,), generator=generator)


def vit_optimizer(model: nn.Module, loss_fn: Any = F.cross_entropy, **options: Any) -> Any:
    users = options.pop("users", False)
    return dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=options.pop("lr", 0.5), momentum=0.9),
        model,
        loss_fn,
        max_norm=MAX_NORM,
        expected_batch_size=USER_SAMPLE_RATE * 6 if users else EXPECTED_BATCH_SIZE,
        **options,
    )


def bare_hooks(model: nn.Module) -> int:
    """How many forward hooks the modules without a layer rule hold (none is left behind)."""
    kinds = (Embeddings, LayerScale, BareLinear)
    return sum(len(m._forward_hooks) for m in model.modules() if isinstance(m, kinds))


# --- the worker -------------------------------------------------------------------------------


def worker(world_size: int, rank: int, store: str, out: str) -> None:
    join_gloo(world_size, rank, store)
    seen: dict[str, Any] = {}
    data = make_images()

    # float32, example level (the low-memory norm pass, the clipped sum through FSDP)
    model = make_vit()
    optimizer = vit_optimizer(model, noise_multiplier=0.0, distributed=True)
    seen["stats"] = [optimizer.step(data[0][i], data[1][i]) for i in batches(world_size, rank)]
    seen["steps"] = gathered(model)
    seen["hooks"] = bare_hooks(model)
    seen.update(beside_sharded_modules(world_size, rank, data))
    seen.update(mixing_refused(rank, data))

    if os.environ.get("PERGRAD_FSDP_UNITS_ALL") == "1":
        seen.update(more_scenarios(world_size, rank, data))

    leave_gloo(seen, out, rank)


def more_scenarios(world_size: int, rank: int, data: Any) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    # noise from rank 0's generator (each rank seeds its own differently)
    model = make_vit()
    generator = torch.Generator().manual_seed(NOISE_SEED + rank)
    optimizer = vit_optimizer(
        model, lr=1.0, noise_multiplier=NOISE_MULTIPLIER, generator=generator, distributed=True
    )
    indices = batches(world_size, rank)[noise_step()]
    optimizer.step(data[0][indices], data[1][indices])
    seen["noise"] = gathered(model)

    # mixed precision: the clipped sum from the records and the formed gradients, in float32
    model = make_vit(bf16_policy())
    optimizer = vit_optimizer(model, float32_loss, noise_multiplier=0.0, distributed=True)
    for indices in batches(world_size, rank):
        optimizer.step(data[0][indices], data[1][indices])
    seen["mixed"] = gathered(model)
    # ... each example's clipped gradient within max_norm: single-example steps (inputs 30
    # times the data's), the clipped sum read from .grad
    model = make_vit(bf16_policy())
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        float32_loss,
        max_norm=MAX_NORM,
        noise_multiplier=0.0,
        expected_batch_size=1,
        distributed=True,
    )
    norms = []
    for example in range(BOUND_EXAMPLES):
        rows = [example] if rank == 0 else []
        optimizer.step(data[0][rows] * 30.0, data[1][rows])
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        norms.append(float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))))
    seen["mixed bound"] = norms

    # torch.autocast around the step, float32 shards
    model = make_vit()
    optimizer = vit_optimizer(model, float32_loss, noise_multiplier=0.0, distributed=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for indices in batches(world_size, rank):
            optimizer.step(data[0][indices], data[1][indices])
    seen["autocast"] = gathered(model)

    # user level: each user's examples on one process
    model = make_vit()
    optimizer = vit_optimizer(model, users=True, noise_multiplier=0.0, distributed=True)
    for step in user_batches():
        mine = of_rank(step, world_size, rank)
        optimizer.step(data[0][mine], data[1][mine], user_ids=USERS[mine])
    seen["users"] = gathered(model)
    return seen


def mixing_refused(rank: int, data: Any) -> dict[str, Any]:
    """A unit that mixes the examples, refused by its step on every process (each process
    sees it: its rows do not reproduce), the model left as it was."""
    model = Mixing()
    shard(model, [model.head])
    optimizer = vit_optimizer(model, noise_multiplier=0.0, distributed=True)
    before = gathered(model)
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    rows = [2 * rank, 2 * rank + 1]
    seen = {"mixing": error_of(lambda: optimizer.step(data[0][rows], data[1][rows]))}
    after = gathered(model)
    seen["mixing left as it was"] = {
        "values": all(torch.equal(before[n], after[n]) for n in before),
        "no .grad": all(p.grad is None for p in model.parameters()),
        "hooks": hooks
        == [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()],
        "sharded": all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()),
    }
    return seen


def beside_sharded_modules(world_size: int, rank: int, data: Any) -> dict[str, Any]:
    """Bare parameters whose module is, or holds, an FSDP2 module (``fsdp_broadcast.py``: read
    off the forward pass): timm's position embeddings on the model itself, and the ViT's
    embeddings module sharded on its own (gathered while it runs, resharded after)."""
    seen = {}
    root = RootPositions()
    shard(root, [root.head])
    optimizer = vit_optimizer(root, noise_multiplier=0.0, distributed=True)
    for indices in batches(world_size, rank):
        optimizer.step(data[0][indices], data[1][indices])
    seen["root"] = gathered(root)
    vit = TinyViT()
    shard(vit, [vit.embeddings, *vit.blocks])
    optimizer = vit_optimizer(vit, noise_multiplier=0.0, distributed=True)
    for indices in batches(world_size, rank):
        optimizer.step(data[0][indices], data[1][indices])
    seen["sharded unit"] = gathered(vit)
    return seen


# --- the tests --------------------------------------------------------------------------------

SLOW = pytest.mark.slow(
    reason="spawns gloo processes: about 10 s a run, 30-60 s with every scenario"
)


@pytest.fixture(
    scope="module",
    # (all slow: spawning gloo processes takes ~9 s of the ~13 s; the default suite keeps the
    # in-process test at the end and test_fsdp_torch.py's runs)
    params=[
        pytest.param((2, False), marks=SLOW),
        pytest.param((2, True), marks=SLOW),
        pytest.param((4, True), marks=SLOW),
    ],
    ids=["2 processes", "2 processes, all", "4 processes, all"],
)
def workers(request, tmp_path_factory) -> tuple[int, list[dict[str, Any]]]:
    world_size, every = request.param
    directory = tmp_path_factory.mktemp(f"fsdp_units{world_size}")
    os.environ["PERGRAD_FSDP_UNITS_ALL"] = "1" if every else "0"
    try:
        seen = run_workers(world_size, directory, transformer=False, script=__file__)
    finally:
        del os.environ["PERGRAD_FSDP_UNITS_ALL"]
    return world_size, seen


# the tests of the scenarios played in the runs with every scenario only
EVERY = pytest.mark.parametrize(
    "workers",
    [pytest.param((2, True), marks=SLOW), pytest.param((4, True), marks=SLOW)],
    indirect=True,
    ids=["2 processes, all", "4 processes, all"],
)


def reference(
    steps: list[list[int]], make: Any = TinyViT, **options: Any
) -> tuple[list[Any], dict[str, Any]]:
    """The single-process DPOptimizer's steps over ``steps`` (lists of example indices)."""
    model, (x, y) = make(), make_images()
    users = options.get("users", False)
    optimizer = vit_optimizer(model, **options)
    stats = [optimizer.step(x[i], y[i], **({"user_ids": USERS[i]} if users else {})) for i in steps]
    return stats, {name: p.detach().clone() for name, p in model.named_parameters()}


BARE = ["embeddings.cls_token", "embeddings.pos_embed", "blocks.0.down.weight"]


def assert_bare_moved(got: dict[str, torch.Tensor]) -> None:
    initial = {name: p.detach() for name, p in TinyViT().named_parameters()}
    for name in [*BARE, "blocks.1.scale.gamma"]:
        assert float((got[name] - initial[name]).abs().max()) > 1e-3, name


def test_a_vit_with_bare_parameters_steps_as_in_one_process(workers):
    world_size, seen = workers
    stats, expected = reference(batches(), noise_multiplier=0.0)
    assert {s.clip_fraction for s in stats if s.batch_size} == {1.0}  # every example clipped
    assert_bare_moved(expected)
    for rank in range(world_size):
        assert_params_equal(seen[rank]["steps"], expected)
        got = seen[rank]["stats"]
        assert {s.strategy for s in got} == {"ghost-fsdp"}
        assert [s.clip_fraction for s in got] == pytest.approx([s.clip_fraction for s in stats])
        assert seen[rank]["hooks"] == 0


@pytest.mark.parametrize("case", ["root", "sharded unit"])
def test_parameters_of_a_module_holding_fsdp_modules_step_as_in_one_process(workers, case):
    world_size, seen = workers
    make = RootPositions if case == "root" else TinyViT
    _, expected = reference(batches(), make, noise_multiplier=0.0)
    initial = {name: p.detach() for name, p in make().named_parameters()}
    moved = ["pos_embed"] if case == "root" else ["embeddings.cls_token", "embeddings.pos_embed"]
    for name in moved:
        assert float((expected[name] - initial[name]).abs().max()) > 1e-3, name
    for rank in range(world_size):
        assert_params_equal(seen[rank][case], expected)


def test_a_unit_that_mixes_the_examples_fails_its_step_on_every_process(workers):
    world_size, seen = workers
    for rank in range(world_size):
        got = seen[rank]["mixing"]
        assert got.startswith("PergradValueError: DPOptimizer: on an FSDP2 model, ") and (
            "layer 'center' (Centered)" in got and "does not reproduce its output" in got
        ), got
        assert all(seen[rank]["mixing left as it was"].values()), seen[rank][
            "mixing left as it was"
        ]


@EVERY
def test_the_noise_is_the_single_process_noise(workers):
    world_size, seen = workers
    generator = torch.Generator().manual_seed(NOISE_SEED)
    _, expected = reference(
        [batches()[noise_step()]], lr=1.0, noise_multiplier=NOISE_MULTIPLIER, generator=generator
    )
    _, quiet = reference([batches()[noise_step()]], lr=1.0, noise_multiplier=0.0)
    for rank in range(world_size):
        assert_params_equal(seen[rank]["noise"], expected)
        std = NOISE_MULTIPLIER * MAX_NORM / EXPECTED_BATCH_SIZE  # (lr 1)
        for name in BARE:  # the noise is there, far above the tolerance
            assert float((seen[rank]["noise"][name] - quiet[name]).std()) > std / 3, name


@EVERY
@pytest.mark.parametrize("case", ["mixed", "autocast"])
def test_mixed_precision_steps_as_in_one_process_to_bfloat16s_rounding(workers, case):
    world_size, seen = workers
    _, expected = reference(batches(), loss_fn=float32_loss, noise_multiplier=0.0)
    initial = {name: p.detach() for name, p in TinyViT().named_parameters()}
    for rank in range(world_size):
        for name, value in expected.items():
            got = seen[rank][case][name]
            moved = float((value - initial[name]).abs().max())
            # (FSDP runs every layer in bfloat16: a few % of the moves apart)
            torch.testing.assert_close(got, value, rtol=0, atol=0.05 * moved + 1e-4, msg=name)


@EVERY
def test_mixed_precision_keeps_every_example_within_max_norm(workers):
    world_size, seen = workers
    for rank in range(world_size):
        norms = seen[rank]["mixed bound"]
        assert len(norms) == BOUND_EXAMPLES
        for norm in norms:  # clipped, and to float32 rounding
            assert MAX_NORM * (1 - 1e-3) < norm <= MAX_NORM * (1 + 1e-5), norms


@EVERY
def test_user_level_steps_as_in_one_process(workers):
    world_size, seen = workers
    _, expected = reference(user_batches(), users=True, noise_multiplier=0.0)
    assert_bare_moved(expected)
    for rank in range(world_size):
        assert_params_equal(seen[rank]["users"], expected)


if __name__ == "__main__":
    world_size_arg, rank_arg, store_arg, out_arg = sys.argv[1:]
    worker(int(world_size_arg), int(rank_arg), store_arg, out_arg)


def test_the_units_sum_check_runs_once_per_layout_across_batch_sizes(monkeypatch):
    """In one process (no FSDP needed: ``fsdp_units`` runs on the records alone): the formed
    per-example gradients equal the loop's at every batch size, and the sum check against the
    unit's batch gradient (one more pass of the unit) runs on the first batch only, as in the
    single-process route: Poisson batches do not pay it at every step."""
    from _reference import torch_module_loop_grads
    from pergrad._src.capture.torch_plan import GENERIC, ownership
    from pergrad._src.torch import fsdp_units

    checks: list[str] = []
    original = fsdp_units.check_sums
    monkeypatch.setattr(
        fsdp_units, "check_sums", lambda unit, *a: (checks.append(unit), original(unit, *a))
    )
    torch.manual_seed(0)
    model = nn.Sequential(Embeddings(), nn.Flatten(), nn.Linear((PATCHES + 1) * WIDTH, CLASSES))
    params = dict(model.named_parameters())
    layers = {"0": GENERIC, "0.patch": "linear", "2": "linear"}
    owners = ownership(model, params, layers)
    for size in (7, 9, 3):  # (no size of another axis: 4, 5, 6, 8 would be checked again)
        x, y = torch.randn(size, PATCHES, PATCH), torch.randint(0, CLASSES, (size,))
        with fsdp_units.capturing_units(owners.units, size) as capture:
            total = F.cross_entropy(model(x), y, reduction="sum")
            torch.autograd.grad(total, capture.targets)
        dtypes = {name: p.dtype for name, p in params.items()}
        grads = fsdp_units.formed_gradients(owners, capture, size, dtypes)
        want = torch_module_loop_grads(model, F.cross_entropy, [x], [y])
        assert set(grads) == {"0.cls_token", "0.pos_embed"}  # (the patch layer has a rule)
        for name, value in grads.items():
            torch.testing.assert_close(value, want[name], rtol=1e-4, atol=1e-6)
    assert checks == ["0"]
