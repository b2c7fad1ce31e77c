"""Which route ``strategy="auto"`` takes for a DP step, against every route timed (issue 36).

Run:  python benchmarks/auto_choice.py [--quick] [--rounds N] [--threads N] [--out PATH.md]

The committed results: ``python benchmarks/auto_choice.py --out
benchmarks/results/cpu/auto_choice.md`` (about 2 minutes on 2 idle cores).

Workloads, each a ``pergrad.dp.DPOptimizer`` step (``torch.optim.SGD``, ``max_norm=1``,
``noise_multiplier=1``, one fixed batch):

* ``MNIST conv``: Opacus's own MNIST example, its ``SampleConvNet`` (conv 1->16 k8 s2 p3,
  max-pool 2/1, conv 16->32 k4 s2, max-pool 2/1, fc 512->32, fc 32->10), batch 64 and batch
  16 of 28x28 images: a small model whose convolutions' ghost norms form each example's
  kernel gradient anyway, so that the ghost strategy's fixed cost per layer decides on a
  small batch;
* ``MLP``: 784 -> 256 -> 256 -> 10, batch 64 (one position per layer: the ghost norms are
  closed forms);
* ``wide MLP``: 784 -> 1024 -> 1024 -> 10, batch 64;
* ``transformer``: two pre-norm blocks (width 256, 4 heads, MLP 4x, ``nn.Linear`` and
  ``nn.LayerNorm``, scaled dot-product attention), an embedding and a linear head: 256 tokens,
  batch 8 (13.7 M per-example numbers, within ``cost.MAX_FORMED_NUMBERS``; materialising is
  estimated faster, but would hold about twice what the ghost norms hold: the ghost norms, by
  memory, ``cost.FREE_FORMED_NUMBERS``), and 128 tokens, batch 32 (55 M: past
  ``MAX_FORMED_NUMBERS``, so the ghost norms).

Methods, each on its own copy of the model (same initialisation, same batch), timed in
interleaved rounds (``pergrad.bench.timing.time_interleaved``, one warm-up step each, which
also runs the ghost strategy's first-call checks): ``non-private`` (forward, backward, SGD
step: the unit of every ratio), ``pergrad auto`` (and the route it took, with
``choose_strategy``'s reason), ``ghost``, ``materialize``, ``chunked`` (strategy forced) and
``Opacus hooks`` (``PrivacyEngine().make_private``, where Opacus is installed). Columns: the
median time, its ratio to the non-private step (median of per-round ratios), and ``auto`` /
best: the auto step's time over the fastest pergrad route's (median of per-round ratios).

Prints a markdown table; ``--out PATH.md`` also writes it with the machine and its load named.
``--quick``: smaller batches (the MNIST rows as they are), 2 rounds (a smoke test).
"""

from __future__ import annotations

import argparse
import copy
import platform
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pergrad.bench import machine
from pergrad.bench.report import fmt, markdown_table, publish, titled
from pergrad.bench.timing import median_ms, paired_ratio, time_interleaved

MAX_NORM, NOISE, LEARNING_RATE = 1.0, 1.0, 1e-3
BASE = "non-private"
# method -> DPOptimizer's strategy
ROUTES = {
    "pergrad auto": "auto",
    "ghost": "ghost",
    "materialize": "materialize",
    "chunked": "chunked",
}
OPACUS = "Opacus hooks"


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], Any]  # () -> model
    batch: Callable[[int], tuple[Any, Any]]  # batch size -> (inputs, targets)
    batch_size: int
    quick_batch_size: int


def sample_conv_net() -> Any:
    """Opacus's ``examples/mnist.py`` ``SampleConvNet``, layer for layer."""
    import torch.nn.functional as F
    from torch import nn

    class SampleConvNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
            self.conv2 = nn.Conv2d(16, 32, 4, 2)
            self.fc1 = nn.Linear(32 * 4 * 4, 32)
            self.fc2 = nn.Linear(32, 10)

        def forward(self, x: Any) -> Any:
            x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)  # (B, 16, 13, 13)
            x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)  # (B, 32, 4, 4)
            return self.fc2(F.relu(self.fc1(x.view(-1, 32 * 4 * 4))))

    return SampleConvNet()


def mlp(widths: tuple[int, ...]) -> Callable[[], Any]:
    def build() -> Any:
        from torch import nn

        layers: list[Any] = []
        for width_in, width_out in zip(widths, widths[1:]):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        return nn.Sequential(*layers[:-1])

    return build


def transformer(width: int = 256, heads: int = 4, depth: int = 2, vocab: int = 512) -> Any:
    """A small pre-norm transformer of ``nn.Linear`` / ``nn.LayerNorm`` / ``nn.Embedding``,
    classifying each sequence from its mean token (one loss per example)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x: Any) -> Any:
            batch, length, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).split(width, -1)
            q, k, v = (t.view(batch, length, heads, -1).transpose(1, 2) for t in (q, k, v))
            mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(mixed.transpose(1, 2).reshape(batch, length, width))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.Sequential(*(Block() for _ in range(depth)))
            self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 10)

        def forward(self, tokens: Any) -> Any:
            return self.head(self.norm(self.blocks(self.embed(tokens))).mean(1))

    torch.manual_seed(0)
    return Model()


def images(size: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randn(size, 1, 28, 28, generator=generator), torch.randint(
        0, 10, (size,), generator=generator
    )


def flat_inputs(size: int) -> tuple[Any, Any]:
    x, y = images(size)
    return x.view(size, -1), y


def short_tokens(size: int) -> tuple[Any, Any]:
    return tokens(size, 128)


def tokens(size: int, length: int = 256) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 512, (size, length), generator=generator), torch.randint(
        0, 10, (size,), generator=generator
    )


WORKLOADS = (
    Workload("MNIST conv (Opacus's SampleConvNet)", sample_conv_net, images, 64, 64),
    Workload("MNIST conv, batch 16", sample_conv_net, images, 16, 16),
    Workload("MLP 784-256-256-10", mlp((784, 256, 256, 10)), flat_inputs, 64, 16),
    Workload("wide MLP 784-1024-1024-10", mlp((784, 1024, 1024, 10)), flat_inputs, 64, 16),
    Workload("transformer, 256 tokens", transformer, tokens, 8, 2),
    Workload("transformer, 128 tokens", transformer, short_tokens, 32, 20),
)


def dp_step(model: Any, inputs: Any, targets: Any, strategy: str) -> tuple[Callable, dict]:
    """A pergrad DP step on ``model`` and what it took: ``{"strategy": ...}``."""
    import torch
    import torch.nn.functional as F

    import pergrad

    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    private = pergrad.dp.DPOptimizer(
        optimizer,
        model,
        F.cross_entropy,
        max_norm=MAX_NORM,
        noise_multiplier=NOISE,
        expected_batch_size=len(targets),
        strategy=strategy,
    )
    taken: dict[str, Any] = {}

    def step() -> None:
        taken["strategy"] = private.step(inputs, targets).strategy

    return step, taken


def plain_step(model: Any, inputs: Any, targets: Any) -> Callable[[], None]:
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    return step


def opacus_step(model: Any, inputs: Any, targets: Any) -> Callable[[], None]:
    import torch
    import torch.nn.functional as F
    from opacus import PrivacyEngine

    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(len(targets), 1)), batch_size=len(targets)
    )
    private_model, private_optimizer, _ = PrivacyEngine().make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=NOISE,
        max_grad_norm=MAX_NORM,
        poisson_sampling=False,
    )

    def step() -> None:
        private_optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(private_model(inputs), targets).backward()
        private_optimizer.step()

    return step


def has_opacus() -> bool:
    try:
        import opacus  # noqa: F401
    except ImportError:
        return False
    return True


def measure(workload: Workload, quick: bool, rounds: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import pergrad

    size = workload.quick_batch_size if quick else workload.batch_size
    inputs, targets = workload.batch(size)
    torch.manual_seed(0)
    original = workload.build()
    model_size = sum(p.numel() for p in original.parameters())
    loss = pergrad.module_loss(original, F.cross_entropy)
    choice = pergrad.norms.choose_strategy(loss, loss.params(), inputs, targets, clipped_sum=True)
    steps: dict[str, Callable[[], None]] = {
        BASE: plain_step(copy.deepcopy(original), inputs, targets)
    }
    taken: dict[str, dict[str, Any]] = {}
    for method, strategy in ROUTES.items():
        steps[method], taken[method] = dp_step(copy.deepcopy(original), inputs, targets, strategy)
    if has_opacus():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            steps[OPACUS] = opacus_step(copy.deepcopy(original), inputs, targets)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's secure-RNG and hook warnings
        times = time_interleaved(steps, rounds, warmup=1)
    fastest = min(ROUTES, key=lambda m: median_ms(times[m]))
    return {
        "workload": workload,
        "batch": size,
        "params": model_size,
        "times": times,
        "auto took": taken["pergrad auto"].get("strategy"),
        "chosen": choice.strategy,
        "reason": choice.reason,
        "fastest": fastest,
        "auto/best": paired_ratio(times["pergrad auto"], times[fastest]),
    }


def table(results: list[dict[str, Any]]) -> str:
    methods = [BASE, *ROUTES, *([OPACUS] if has_opacus() else [])]
    header = ["workload", "B", "P", *methods, "auto took", "auto / best"]
    rows = []
    for result in results:
        times = result["times"]
        cells = [fmt(median_ms(times[BASE]), ".1f", " ms")]
        for method in methods[1:]:
            ratio = paired_ratio(times[method], times[BASE])
            cells.append(f"{median_ms(times[method]):.1f} ms ({ratio:.2f}x)")
        rows.append(
            [
                result["workload"].name,
                str(result["batch"]),
                f"{result['params']:,}",
                *cells,
                result["auto took"],
                f"{result['auto/best']:.2f} (best: {result['fastest']})",
            ]
        )
    return markdown_table(header, rows)


def reasons(results: list[dict[str, Any]]) -> str:
    lines = ["Why `auto` took its route (`choose_strategy(..., clipped_sum=True).reason`):", ""]
    for result in results:
        lines.append(f"- {result['workload'].name}: **{result['chosen']}**: {result['reason']}")
    return "\n".join(lines)


def header(args: argparse.Namespace, load_at_start: str) -> str:
    import torch

    return titled(
        'Which route `strategy="auto"` takes for a DP step, against each route (CPU)',
        [
            f"machine: {machine.cpu_and_cores()}, torch threads {torch.get_num_threads()}; "
            f"{platform.system()}, " + machine.software("torch", "opacus", "pergrad"),
            f"date: {machine.timestamp()}; load average {machine.load_span(load_at_start)}",
            f"time: median of {args.rounds} interleaved rounds after a warm-up step; in "
            f"brackets the ratio to the non-private step (median of per-round ratios); "
            f"DPOptimizer(SGD), max_norm {MAX_NORM}, noise_multiplier {NOISE}",
            f"command: `{machine.command_line()}`",
        ],
    )


def sweep(batch_sizes: list[int], rounds: int) -> str:
    """The MNIST conv net's DP step by batch size: ghost and materialising timed side by side,
    against the cost model's estimates of their extra work (``choose_strategy(...,
    clipped_sum=True)``, which "auto" follows): where the measured ratio crosses 1 is where
    the model's should."""
    import torch
    import torch.nn.functional as F

    import pergrad
    from pergrad._src.capture import cost, torch_held, torch_probe
    from pergrad._src.capture.torch_plan import ownership

    rows = []
    for size in batch_sizes:
        inputs, targets = images(size)
        torch.manual_seed(0)
        original = sample_conv_net()
        loss = pergrad.module_loss(original, F.cross_entropy)
        params = loss.params()
        choice = pergrad.norms.choose_strategy(loss, params, inputs, targets, clipped_sum=True)
        holdable = frozenset(
            torch_held.candidate_layers(ownership(original, params, choice.layers))
        )
        works = torch_probe.layer_works(loss, choice.layers, 0, (params, inputs, targets), holdable)
        assert not isinstance(works, str), works
        estimate = cost.route_costs(size, sum(p.numel() for p in params.values()), works)
        steps = {BASE: plain_step(copy.deepcopy(original), inputs, targets)}
        for route in ("ghost", "materialize"):
            steps[route], _ = dp_step(copy.deepcopy(original), inputs, targets, route)
        times = time_interleaved(steps, rounds, warmup=1)
        extra = {r: median_ms(times[r]) - median_ms(times[BASE]) for r in ("ghost", "materialize")}
        rows.append(
            [
                str(size),
                f"{median_ms(times[BASE]):.2f} ms",
                f"{median_ms(times['ghost']):.2f} ms",
                f"{median_ms(times['materialize']):.2f} ms",
                f"{paired_ratio(times['ghost'], times['materialize']):.2f}",
                f"{extra['ghost'] / max(extra['materialize'], 1e-9):.2f}",
                f"{estimate.ghost / estimate.materialize:.2f}",
                choice.strategy,
            ]
        )
        print(rows[-1], flush=True)
    header = ["B", BASE, "ghost", "materialize", "ghost / materialize", "extra time, ghost / "
              "materialize", "model's extra work, ghost / materialize", "auto takes"]  # fmt: skip
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batches, 2 rounds")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, help="write the markdown here")
    parser.add_argument(
        "--sweep",
        type=lambda text: [int(b) for b in text.split(",")],
        help="batch sizes (e.g. 8,16,32,64): the MNIST conv net's ghost / materialise crossover "
        "against the cost model's, instead of the workloads",
    )
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.rounds = 2
    load_at_start = machine.load_average()
    if args.sweep:
        text = sweep(args.sweep, args.rounds)
        publish(text, args.out, lambda: header(args, load_at_start))
        return
    results = []
    for workload in WORKLOADS:
        results.append(measure(workload, args.quick, args.rounds))
        print(table(results[-1:]), flush=True)
    text = "\n\n".join([table(results), reasons(results)])
    publish(text, args.out, lambda: header(args, load_at_start))


if __name__ == "__main__":
    main()
