"""What pergrad makes itself (noise, projections, masks, indices, weights) follows the device and
the dtype of the user's arrays.

Four checks that run on the CPU:

* the meta device: user tensors on ``meta`` (shapes only). A tensor pergrad made on the CPU
  instead either breaks the call (mixed devices) or shows up in the result. Paths that read
  values (first-call checks of the hooks and ghost strategies, outlier statistics) cannot run
  there; they run in the next check when ``PERGRAD_TEST_DEVICE`` is a GPU.
* the default dtype: torch's default dtype set to float64, the user's arrays float32 or
  bfloat16 (a tensor pergrad made with the default dtype promotes the results to float64), or
  float64 (a tensor made in a fixed lower precision shows). It runs on ``PERGRAD_TEST_DEVICE``,
  so on a GPU it checks the devices of every path too.
* noise: torch refuses, on CUDA only, a generator of another device than the draw's; the CPU
  does not check, so a stand-in for ``torch.randn`` does.
* the source: every torch factory call in the package (``torch.zeros``, ``torch.arange``,
  ``torch.Generator``, ...) passes ``device=``, or its result is moved with ``.to(...)`` at
  once, or it is one of the reviewed exceptions below, each with its reason.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

import pergrad

torch = pytest.importorskip("torch", reason="the device checks are about torch tensors")

from torch import nn  # noqa: E402

BATCH, WIDTH, OUT = 6, 4, 3


class Inputs(NamedTuple):
    params: dict[str, Any]
    x: Any
    y: Any
    labels: Any
    grads: dict[str, Any]
    summed: dict[str, Any]
    mask: Any
    model: nn.Module


def make_inputs(device: Any, dtype: Any) -> Inputs:
    """Seeded on the CPU, then moved: the same numbers on every device."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> Any:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    model = nn.Sequential(nn.Linear(WIDTH, 5), nn.Tanh(), nn.Linear(5, OUT))
    return Inputs(
        params={"w": randn(WIDTH, OUT), "b": randn(OUT)},
        x=randn(BATCH, WIDTH),
        y=randn(BATCH, OUT),
        labels=torch.arange(BATCH, device=device) % OUT,
        grads={"w": randn(BATCH, WIDTH, OUT), "b": randn(BATCH, OUT)},
        summed={"w": randn(WIDTH, OUT), "b": randn(OUT)},
        mask=torch.arange(BATCH, device=device) < BATCH - 1,  # the last example is padding
        model=model.to(device=device, dtype=dtype),
    )


def linear_loss(params: dict[str, Any], x: Any, y: Any) -> Any:
    return ((x @ params["w"] + params["b"] - y) ** 2).sum()


def module_grads(strategy: str) -> Callable[[Inputs], Any]:
    def call(i: Inputs) -> Any:
        loss = pergrad.module_loss(i.model, nn.functional.cross_entropy)
        return pergrad.per_example_grads(loss, strategy=strategy)(loss.params(), i.x, i.labels)

    return call


def ghost_norms(i: Inputs) -> Any:
    loss = pergrad.module_loss(i.model, nn.functional.cross_entropy)
    return pergrad.norms.per_example_norms_of(loss, loss.params(), i.x, i.labels, strategy="ghost")


def private(call: Callable[..., Any]) -> Callable[[Inputs], Any]:
    return lambda i: call(i, max_norm=1.0, noise_multiplier=1.0, rng=None, expected_batch_size=5)


# name: (call, reads values: not runnable on the meta device)
CASES: dict[str, tuple[Callable[[Inputs], Any], bool]] = {
    "per_example_grads": (lambda i: pergrad.per_example_grads(linear_loss)(*i[:3]), False),
    "per_example_grads chunked": (
        lambda i: pergrad.per_example_grads(linear_loss, chunk_size=4)(*i[:3]),
        False,
    ),
    "per_example_grads loop": (
        lambda i: pergrad.per_example_grads(linear_loss, strategy="loop")(*i[:3]),
        False,
    ),
    "value_and_per_example_grads": (
        lambda i: pergrad.value_and_per_example_grads(linear_loss)(*i[:3]),
        False,
    ),
    "module_loss vmap": (module_grads("vmap"), False),
    "module_loss hooks": (module_grads("hooks"), True),
    "norms.per_example_norms": (lambda i: pergrad.norms.per_example_norms(i.grads), False),
    "norms.per_example_norms per_layer": (
        lambda i: pergrad.norms.per_example_norms(i.grads, per_layer=True),
        False,
    ),
    "norms.cosine_to_mean": (lambda i: pergrad.norms.cosine_to_mean(i.grads), False),
    "norms.per_example_norms_of": (
        lambda i: pergrad.norms.per_example_norms_of(linear_loss, *i[:3]),
        False,
    ),
    "norms.per_example_norms_of ghost": (ghost_norms, True),
    "dp.clip": (lambda i: pergrad.dp.clip(i.grads, 1.0), False),
    "dp.clipped_sum": (lambda i: pergrad.dp.clipped_sum(i.grads, 1.0), False),
    "dp.clipped_sum mask": (lambda i: pergrad.dp.clipped_sum(i.grads, 1.0, mask=i.mask), False),
    "dp.add_noise": (lambda i: pergrad.dp.add_noise(i.summed, 1.0, None), False),
    "dp.add_noise CPU generator": (
        lambda i: pergrad.dp.add_noise(i.summed, 1.0, torch.Generator().manual_seed(1)),
        False,
    ),
    "dp.private_mean": (private(lambda i, **kw: pergrad.dp.private_mean(i.grads, **kw)), False),
    "dp.clipped_sum_of": (
        lambda i: pergrad.dp.clipped_sum_of(linear_loss, *i[:3], max_norm=1.0),
        False,
    ),
    "dp.private_grad_of": (
        private(lambda i, **kw: pergrad.dp.private_grad_of(linear_loss, *i[:3], **kw)),
        False,
    ),
    "influence.project": (lambda i: pergrad.influence.project(i.grads, 4, seed=0), False),
    "outliers.detect": (
        lambda i: pergrad.outliers.detect(pergrad.norms.per_example_norms(i.grads), "zscore"),
        True,
    ),
}

NO_NUMPY_BFLOAT16 = (
    "bfloat16 has no numpy dtype: the backend's to_numpy (outliers, noise scale) and "
    "as_backend_array (projection) fail on it"
)
# (case, user dtype): why the result does not (yet) keep the user's dtype.
KNOWN_DTYPE_OFFENDERS = {
    ("influence.project", "bfloat16"): NO_NUMPY_BFLOAT16,
    ("outliers.detect", "bfloat16"): NO_NUMPY_BFLOAT16,
    ("outliers.detect", "float64"): (
        "OutlierResult.scores is float32 whatever the scores' dtype "
        "(`statistic.astype(np.float32)` in _src/outliers.py)"
    ),
}


def tensors_in(result: Any) -> list[Any]:
    """Every tensor in a result: pytrees, named tuples and dataclasses (NoiseScale, TopK...)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return tensors_in([getattr(result, f.name) for f in dataclasses.fields(result)])
    if isinstance(result, dict):
        return tensors_in(list(result.values()))
    if isinstance(result, (list, tuple)):
        return [t for item in result for t in tensors_in(item)]
    return []


def same_device(a: Any, b: Any) -> bool:
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return a.type != "cuda" or (a.index or 0) == (b.index or 0)


@pytest.fixture
def float64_default():
    """torch's default dtype float64 for one test: what pergrad makes with it stands out."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.mark.parametrize("name", [name for name, (_, reads) in CASES.items() if not reads])
def test_shape_only_paths_make_their_tensors_on_the_users_device(name: str) -> None:
    call, _ = CASES[name]
    result = call(make_inputs("meta", torch.float32))
    tensors = tensors_in(result)
    assert tensors, f"{name}: no tensor in the result"
    assert {t.device.type for t in tensors} == {"meta"}, name


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("name", list(CASES))
def test_results_keep_the_users_device_and_dtype(
    name: str, dtype_name: str, device: Any, float64_default: None, request: Any
) -> None:
    """On PERGRAD_TEST_DEVICE (the CPU by default), with the default dtype float64: every
    tensor of the result is on the user's device, every floating one in the user's dtype."""
    if reason := KNOWN_DTYPE_OFFENDERS.get((name, dtype_name)):
        request.applymarker(pytest.mark.xfail(reason=reason, strict=True))
    dtype = getattr(torch, dtype_name)
    call, _ = CASES[name]
    tensors = tensors_in(call(make_inputs(device, dtype)))
    assert tensors, f"{name}: no tensor in the result"
    assert all(same_device(t.device, device) for t in tensors), [t.device for t in tensors]
    floating = [t.dtype for t in tensors if t.is_floating_point()]
    assert set(floating) <= {dtype}, f"{name}: {floating}"


def test_noise_is_drawn_on_the_generators_device_then_moved(monkeypatch) -> None:
    """CUDA refuses `torch.randn(..., generator=<CPU generator>, device="cuda")`; the CPU checks
    nothing, so a stand-in does: a draw happens on its generator's device, and the noise ends
    up on the summed gradient's (meta here, as a GPU would be)."""
    randn = torch.randn
    draws = []

    def strict_randn(*shape: Any, generator: Any = None, device: Any = None, **kwargs: Any) -> Any:
        draws.append(device)
        if generator is not None:
            assert same_device(device or "cpu", generator.device), (device, generator.device)
        return randn(*shape, generator=generator, device=device, **kwargs)

    monkeypatch.setattr(torch, "randn", strict_randn)
    summed = {"w": torch.zeros(3, 2, device="meta"), "b": torch.zeros(2, device="meta")}
    noisy = pergrad.dp.add_noise(summed, 1.0, torch.Generator().manual_seed(0))
    assert draws, "add_noise drew nothing through torch.randn"
    assert {t.device.type for t in noisy.values()} == {"meta"}
    unseeded = pergrad.dp.add_noise(summed, 1.0, None)  # torch's generator of the device
    assert {t.device.type for t in unseeded.values()} == {"meta"}


# ---------------------------------------------------------------------------------------------
# The source.

FACTORIES = {
    "arange",
    "as_tensor",
    "empty",
    "empty_strided",
    "eye",
    "from_numpy",
    "full",
    "Generator",
    "linspace",
    "logspace",
    "normal",
    "ones",
    "rand",
    "randint",
    "randn",
    "randperm",
    "scalar_tensor",
    "tensor",
    "tril_indices",
    "triu_indices",
    "zeros",
}

# (file under src/, enclosing function, factory): why it is right without device=.
REVIEWED = {
    ("pergrad/_src/backends/torch_backend.py", "<module>", "empty"): (
        "a 0-element tensor that gives the pytree structure of a leaf; never data"
    ),
    ("pergrad/_src/backends/torch_backend.py", "TorchBackend.as_differentiable", "tensor"): (
        "a Python scalar argument made differentiable: there is no user array to follow; a 0-d "
        "CPU tensor combines with tensors on any device"
    ),
    ("pergrad/_src/capture/torch_checks.py", "row_weights", "arange"): (
        "the first-call check's row weights, made in float64 on the host and then moved with "
        "`.to(device=like.device, dtype=like.dtype)` (one small host-to-device copy)"
    ),
    ("pergrad/_src/torch/distributed.py", "_float_bits", "tensor"): (
        "a Python float turned into its int64 bits on the host, for a gather of settings"
    ),
    ("pergrad/_src/torch/distributed.py", "_from_bits", "tensor"): (
        "int64 bits turned back into a Python float on the host"
    ),
    ("pergrad/_src/torch/dp_optimizer.py", "DPOptimizer._noisy_totals", "as_tensor"): (
        "ClippedSum.count and clip_fraction are already 0-d tensors on the gradients' device: "
        "as_tensor returns them as they are"
    ),
    ("pergrad/_src/torch/sampling.py", "PoissonBatchSampler.__iter__", "rand"): (
        "the sampler's Bernoulli draws, on the host with its host generator"
    ),
    ("pergrad/_src/torch/sampling.py", "_check_generator", "Generator"): (
        "the samplers' host generator: they draw example indices for a DataLoader, on the host"
    ),
    ("pergrad/_src/torch/sampling.py", "CyclicPoissonBatchSampler.__init__", "randint"): (
        "the cyclic sampler's split of the examples into groups, on the host"
    ),
    ("pergrad/_src/torch/sampling.py", "CyclicPoissonBatchSampler.__init__", "from_numpy"): (
        "the groups as a host tensor of example indices"
    ),
    ("pergrad/_src/torch/sampling.py", "CyclicPoissonBatchSampler.__iter__", "rand"): (
        "the cyclic sampler's Bernoulli draws, on the host with its host generator"
    ),
    ("pergrad/_src/torch/make_private.py", "make_private", "Generator"): (
        "the data loader's host generator for its Poisson sampler (example indices, on the host)"
    ),
    ("pergrad/_src/torch/sampling.py", "UserPoissonBatchSampler.__init__", "from_numpy"): (
        "each example's user id as a host tensor of indices, for the sampler"
    ),
    ("pergrad/_src/torch/sampling.py", "UserPoissonBatchSampler.__iter__", "rand"): (
        "the user sampler's Bernoulli draws, on the host with its host generator"
    ),
    ("pergrad/_src/torch/sampling.py", "UserPoissonBatchSampler.__iter__", "randperm"): (
        "the user sampler's choice of a capped user's examples, on the host"
    ),
    ("pergrad/_src/influence/metagradient_torch.py", "Replay._batch", "as_tensor"): (
        "a step's example indices (numpy) as a host index tensor; moved to each data leaf's "
        "device where it indexes it (`index.to(leaf.device)`)"
    ),
    ("pergrad/_src/influence/metagradient_torch.py", "Replay._check_loss", "zeros"): (
        "the index of the first example, on the host, moved to each data leaf's device where "
        "it indexes it"
    ),
}

PACKAGE_ROOT = Path(pergrad.__file__).parent


def factory_calls_without_device(path: Path, root: Path) -> list[tuple[str, str, str, int]]:
    """``(file relative to root, enclosing function, factory, line)`` of each
    ``torch.<factory>(...)`` call that neither passes ``device=`` nor is moved at once
    (``torch.<factory>(...).to(...)``)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and node.func.attr in FACTORIES
        ):
            continue
        if any(keyword.arg == "device" for keyword in node.keywords):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.attr == "to":
            continue
        scopes, ancestor = [], node
        while ancestor in parents:
            ancestor = parents[ancestor]
            if isinstance(ancestor, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scopes.append(ancestor.name)
        scope = ".".join(reversed(scopes)) or "<module>"
        found.append((path.relative_to(root).as_posix(), scope, node.func.attr, node.lineno))
    return found


def test_the_scan_finds_a_factory_call_without_a_device(tmp_path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch\n"
        "def make(like):\n"
        "    a = torch.zeros(3)\n"
        "    b = torch.zeros(3, device=like.device)\n"
        "    c = torch.arange(3).to(like.device)\n"
        "    return torch.Generator()\n"
    )
    assert factory_calls_without_device(probe, tmp_path) == [
        ("probe.py", "make", "zeros", 3),
        ("probe.py", "make", "Generator", 6),
    ]


def test_every_torch_factory_call_in_pergrad_says_where_its_tensor_goes() -> None:
    root = PACKAGE_ROOT.parent
    paths = sorted(PACKAGE_ROOT.rglob("*.py"))
    found = [hit for path in paths for hit in factory_calls_without_device(path, root)]
    unreviewed = [hit for hit in found if hit[:3] not in REVIEWED]
    assert not unreviewed, (
        "torch factory calls without device= (pass device=like.device, or review them into "
        f"REVIEWED with the reason): {unreviewed}"
    )
    stale = set(REVIEWED) - {hit[:3] for hit in found}
    assert not stale, f"REVIEWED entries that no longer match a call (remove them): {stale}"


# --- host syncs of a training step ------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
def test_a_dp_optimizer_step_reads_the_device_twice(monkeypatch, strategy) -> None:
    """Every read of a tensor's value on the host (``float()``, ``int()``, ``bool()``,
    ``.item()``, ``.tolist()``) waits for a GPU to finish its queue. After a layout's first call
    (whose checks read more), a ``DPOptimizer`` step of pergrad's makes two: whether every
    norm is finite (the non-finite cleaning runs only then) and the step's statistics (clip
    fraction, count, non-finite count) read together. Counted on the CPU: the calls made from
    pergrad's own code."""
    import sys

    package = str(Path(pergrad.__file__).parent)
    reads: list[str] = []

    def counted(name: str) -> Callable[..., Any]:
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(package):
                reads.append(f"{name} at {caller}:{sys._getframe(1).f_lineno}")
            return original(self, *args, **kwargs)

        return read

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 8), nn.Tanh(), nn.Linear(8, OUT))
    optimizer = pergrad.dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        nn.functional.cross_entropy,
        max_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=BATCH,
        strategy=strategy,
    )
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, OUT, (BATCH,))
    optimizer.step(x, y)  # the layout's first call
    for name in ("__float__", "__int__", "__bool__", "__index__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    optimizer.step(x, y)
    assert len(reads) == 2, reads
