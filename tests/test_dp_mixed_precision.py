"""DPOptimizer under mixed precision: torch.autocast (bfloat16, float16) and GradScaler.

The reference is a loop of single-example autograd gradients computed under the same autocast,
clipped and summed in float32. Steps use SGD with lr=1, no noise and expected_batch_size=1, so
the parameters move by exactly minus the clipped sum.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="DPOptimizer is the PyTorch integration")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402

# A fallback to the chunked strategy would hide that the ghost path mishandles low precision.
pytestmark = pytest.mark.filterwarnings("error::pergrad.FallbackWarning")

# bfloat16 keeps 8 significant bits (unit roundoff 2**-9 ~ 0.2%). The batched pass and the
# single-example loop round the activations and output gradients of each layer separately
# (and the loop rounds each weight gradient to bfloat16 once more), so two or three roundings
# compound over two layers: a few tenths of a percent typically; 3% of the sum's norm leaves
# room for unlucky examples while a wrong clip factor or a missing example (>10%) still fails.
BF16_TOLERANCE = 3e-2


class Scale(nn.Module):
    """A learnable per-feature scale: no ghost rule, so it takes the generic path."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def mlp(generic: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8), nn.ReLU(), nn.LayerNorm(8)]
    if generic:
        layers.append(Scale(8))
    return nn.Sequential(*layers, nn.Linear(8, 3))


def batch(size: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(size, 6, generator=generator), torch.randint(
        0, 3, (size,), generator=generator
    )


def dp_step(model: nn.Module, x: Any, y: Any, max_norm: float, **kwargs: Any) -> Any:
    """One zero-noise step with SGD(lr=1): returns (clipped sum, DPStep)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    user_ids = kwargs.pop("user_ids", None)
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        F.cross_entropy,
        max_norm=max_norm,
        noise_multiplier=kwargs.pop("noise_multiplier", 0.0),
        expected_batch_size=1,
        **kwargs,
    )
    stats = optimizer.step(x, y) if user_ids is None else optimizer.step(x, y, user_ids=user_ids)
    moved = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    return moved, stats


def reference_clipped_sum(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, max_norm: float, dtype: Any
) -> dict[str, torch.Tensor]:
    """Per-example autograd gradients under the same autocast, clipped and summed in float32."""
    params = dict(model.named_parameters())
    total = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    for i in range(x.shape[0]):
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(params.values()))
        grads = [g.float() for g in grads]
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        factor = min(1.0, max_norm / float(norm))
        for (n, _), g in zip(params.items(), grads):
            total[n] += factor * g
    return total


def global_norm(tree: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((v.double() ** 2).sum() for v in tree.values())))


def assert_close_sum(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float):
    error = global_norm({n: got[n].double() - want[n].double() for n in want})
    assert error <= rtol * global_norm(want), (error, global_norm(want))


@pytest.mark.parametrize("strategy", ["ghost", "ghost-lowmem"])
@pytest.mark.parametrize("generic", [False, True], ids=["ghost layers", "with a generic layer"])
def test_bfloat16_autocast_step_matches_a_loop_of_clipped_gradients(
    generic: bool, strategy: str
) -> None:
    model = mlp(generic)
    x, y = batch()
    want = reference_clipped_sum(model, x, y, max_norm=0.5, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moved, stats = dp_step(model, x, y, max_norm=0.5, strategy=strategy)
    assert stats.strategy == strategy and not stats.skipped
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert_close_sum(moved, want, BF16_TOLERANCE)


@pytest.mark.parametrize("strategy", ["auto", "ghost-lowmem"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_clip_bound_holds_for_norms_that_overflow_float16_when_squared(
    dtype: Any, strategy: str
) -> None:
    """Inputs of size 300: each squared activation (9e4) and each squared gradient norm
    (above 1e6) is past float16's 65504. Squared in float16 the norm is inf and the example
    is dropped (contribution 0) instead of clipped to max_norm."""
    model = mlp()
    x, y = batch(3)
    for i in range(3):
        with torch.autocast("cpu", dtype=dtype):
            moved, stats = dp_step(
                model, 300.0 * x[i : i + 1], y[i : i + 1], max_norm=1.0, strategy=strategy
            )
        assert stats.clip_fraction == 1.0
        norm = global_norm(moved)
        assert 0.99 <= norm <= 1.0 + 1e-5, (i, norm)
        for p in model.parameters():
            assert torch.isfinite(p).all()


@pytest.mark.parametrize("strategy", ["auto", "ghost-lowmem"])
def test_grad_scaler_step_equals_the_unscaled_step_noise_included(strategy: str) -> None:
    """The gradients are unscaled before clipping (clipping the scaled ones at max_norm would
    shrink the step by the scale) and the noise is added after (its std is max_norm *
    noise_multiplier, not times the scale): the same generator gives the same step."""
    x, y = batch()
    steps = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**12)):
        model = mlp()
        moved, stats = dp_step(
            model,
            x,
            y,
            max_norm=0.5,
            noise_multiplier=1.0,
            generator=torch.Generator().manual_seed(3),
            scaler=scaler,
            strategy=strategy,
        )
        assert not stats.skipped
        steps.append(moved)
    assert_close_sum(steps[1], steps[0], 1e-5)


class CountingAccountant:
    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> None:
        self.steps += 1


@pytest.mark.parametrize("strategy", ["ghost", "ghost-lowmem"])
def test_grad_scaler_overflow_skips_the_step(strategy: str) -> None:
    """float16 autocast with a scale of 2**40: the scaled output gradients overflow. The step
    is skipped (parameters as they were, no .grad), reported, the scale backed off, and the
    accountant still counts it; a later step at a workable scale goes through."""
    model = mlp()
    x, y = batch()
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30)
    accountant = CountingAccountant()
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model,
        F.cross_entropy,
        max_norm=1.0,
        noise_multiplier=0.0,
        scaler=scaler,
        accountant=accountant,
        strategy=strategy,
    )
    with torch.autocast("cpu", dtype=torch.float16):
        stats = optimizer.step(x, y)
    assert stats.skipped and stats.batch_size == 6
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert scaler.get_scale() == 2.0**10
    assert accountant.steps == 1
    with torch.autocast("cpu", dtype=torch.float16):
        stats = optimizer.step(x, y)
    assert not stats.skipped and stats.strategy == strategy
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert accountant.steps == 2


def test_non_finite_gradient_without_a_scaler_is_zeroed_and_reported() -> None:
    """Without a scaler an inf example is zeroed, not a skipped step (the DP guide; the sums
    against a per-example loop are in test_dp_nonfinite.py); the warning names the scaler."""
    model = mlp()
    x, y = batch()
    x[2, 0] = float("inf")
    with pytest.warns(pergrad.NonFiniteWarning, match="scaler=torch.amp.GradScaler"):
        moved, stats = dp_step(model, x, y, max_norm=1.0)
    assert stats.nonfinite == 1 and not stats.skipped
    assert all(bool(m.isfinite().all()) and bool(m.abs().sum() > 0) for m in moved.values())


def test_scaler_must_be_a_grad_scaler() -> None:
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = dict(max_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler.*got str"):
        pergrad.dp.DPOptimizer(sgd, model, F.cross_entropy, scaler="fp16", **kwargs)
    with pytest.raises(ValueError, match="scaler is not supported with distributed"):
        pergrad.dp.DPOptimizer(
            sgd,
            model,
            F.cross_entropy,
            scaler=torch.amp.GradScaler("cpu"),
            distributed=True,
            **kwargs,
        )


# --------------------------------------------------------------------------------------------
# TensorFloat-32 (issue 38: seen on an H100). A TF32 product rounds its inputs to 10 bits; the
# certified norms assume float32's rounding, so pergrad's own products run with TF32 off while
# the user's forward and backward keep the user's setting. The flags are read by CUDA kernels
# only, so on the CPU the test reads which setting each product was issued under.

TF32_FLAGS = ("matmul", "conv")


def tf32_flags() -> tuple[str, str]:
    return (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)


def set_tf32_flags(values: tuple[str, str]) -> None:
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = values


class ProductFlags(torch.overrides.TorchFunctionMode):
    """Records, for every matrix product issued, its function's name and the matmul flag."""

    PRODUCTS = ("linear", "matmul", "mm", "bmm", "einsum", "tensordot", "addmm", "__matmul__")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.PRODUCTS:
            self.seen.append((name, torch.backends.cuda.matmul.fp32_precision))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def user_tf32():
    """The user has TF32 on (``torch.backends.cuda.matmul.fp32_precision = "tf32"``)."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no per-backend fp32_precision flags")
    before = tf32_flags()
    set_tf32_flags(("tf32", "tf32"))
    yield
    set_tf32_flags(before)


@pytest.mark.parametrize(
    "kwargs",
    [{"strategy": "ghost"}, {"strategy": "ghost-lowmem"}, {"strategy": "ghost", "users": True}],
    ids=["ghost", "ghost-lowmem", "user-level ghost"],
)
def test_pergrads_products_run_without_tf32_and_the_users_keep_it(user_tf32, kwargs) -> None:
    model = mlp()
    x, y = batch()
    if kwargs.pop("users", False):
        kwargs["user_ids"] = torch.tensor([0, 0, 1, 2, 2, 2])
    mode = ProductFlags()
    with mode:
        dp_step(model, x, y, max_norm=0.5, **kwargs)
    assert tf32_flags() == ("tf32", "tf32")  # the user's setting, as it was
    forward = [flag for name, flag in mode.seen if name == "linear"]
    own = [flag for name, flag in mode.seen if name != "linear"]
    assert forward and set(forward) == {"tf32"}, mode.seen
    # (the low-memory mode's products run in autograd's hooks, which the mode does not see)
    assert (own or kwargs["strategy"] == "ghost-lowmem") and set(own) <= {"ieee"}, mode.seen


@pytest.mark.parametrize("legacy", ["set_float32_matmul_precision", "allow_tf32", "none"])
def test_full_float32_restores_either_api_and_survives_an_error(legacy: str) -> None:
    from pergrad._src.capture.rules import full_float32

    def legacy_reads() -> list[Any]:
        reads = []
        for read in (
            torch.get_float32_matmul_precision,
            lambda: torch.backends.cuda.matmul.allow_tf32,
            lambda: torch.backends.cudnn.allow_tf32,
        ):
            try:
                reads.append(read())
            except RuntimeError as error:  # torch's own refusal of mixed APIs, before too
                reads.append(type(error).__name__)
        return reads

    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    try:
        if legacy == "set_float32_matmul_precision":
            torch.set_float32_matmul_precision("high")
        elif legacy == "allow_tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = False
        before = legacy_reads(), tf32_flags()
        with pytest.raises(KeyError), full_float32():
            assert tf32_flags() == ("ieee", "ieee")
            raise KeyError("inside")
        assert (legacy_reads(), tf32_flags()) == before
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]


def test_the_bounds_read_the_precision_from_the_new_flags_without_raising(user_tf32) -> None:
    """torch >= 2.9 raises on the old getter once the new flags were set; the bounds' reading
    of the precision a product takes uses the new flags (and is 0 inside pergrad's guard)."""
    from pergrad._src.capture.rules import full_float32
    from pergrad._src.capture.torch_norms import matmul_input_unit

    assert matmul_input_unit("cuda") == 2.0**-11
    before = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        assert matmul_input_unit("cpu") == 2.0**-8
        with full_float32():
            assert matmul_input_unit("cuda") == matmul_input_unit("cpu") == 0.0
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before
