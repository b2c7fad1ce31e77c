"""Host synchronisations and aten ops of one DP step on GPT-2: pergrad against Opacus and the
non-private step, on the CPU (what costs time on an accelerator, found where there is none).

Run:  python benchmarks/dp_step_profile.py [--out PATH.md] [--sites N]

The committed results: ``python benchmarks/dp_step_profile.py --out
benchmarks/results/cpu/dp_step_profile.md`` (about 2 minutes on 2 cores).

On a GPU, an op whose result Python reads (``.item()``, ``bool(tensor)``, ``torch.equal``,
``nonzero``, boolean indexing, a copy to the CPU) stalls the host until the device has caught up,
and every small op is a kernel launch of a few microseconds. The first GPU run (NVIDIA H100,
``benchmarks/results/nvidia-h100-80gb-hbm3/dp_device.md``) found pergrad's ghost DP step on
GPT-2 small 3.29x the non-private step against Opacus's hooks' 2.83x, though it was ahead on the
CPU. This script counts both, for GPT-2 from ``benchmarks/dp_transformers.py`` (its tiny
``QUICK`` config, 1 layer of width 32, 2 examples of 8 tokens, and its small ``FULL`` one, 4
layers of width 256, 16 examples of 128 tokens; tied and untied head): for each method
(non-private, pergrad's ``DPOptimizer`` with ``strategy="auto"``, Opacus's hooks) a few warm-up
steps, the median time of a few more (noisy on a busy machine: context only), then one step

* under ``torch.profiler`` (CPU): the aten ops that launch work (the innermost ``aten::``
  events: those with no ``aten::`` op inside, views included), and the scalar reads and
  value-shaped ops among all events (``aten::_local_scalar_dense``, under every ``.item()``,
  ``bool``, ``float``; ``nonzero``, ``equal``, ``masked_select``, ``unique``). A ``.tolist()``
  reads CPU memory without an aten op: the profiler misses it;
* and one under :class:`pergrad.bench.host_syncs.HostSyncs`: every host sync (the Python reads
  ``tolist``, ``item``, ``bool``, ``float``, ...; the value-shaped ops), with the Python stack of
  each (pergrad's frames: the top call sites), and the aten ops below autograd without views
  (the kernels an accelerator would launch).

``--legacy-syncs`` runs pergrad's step with the reads this change removed put back
(``capture/cost.DEFERRED_READS`` off: each layer's tightening and the tied parameters'
check read where they run, the finiteness apart; the embeddings' ``torch.unique`` is not put
back), for a before/after in one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.dp_transformers import (  # noqa: E402
    FULL,
    GPT2_SMALL,
    QUICK,
    Config,
    Workload,
    batch,
    hf_model,
    opacus_step,
    pergrad_step,
)
from pergrad.bench import machine  # noqa: E402
from pergrad.bench.report import fmt, markdown_table, publish, sentence_header  # noqa: E402

WARMUP_STEPS = 3
TIMED_STEPS = 3
# the profiler's names of the syncs (every scalar read ends in _local_scalar_dense: item,
# is_nonzero and the others above it are not counted again)
PROFILED_SYNCS = (
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::equal",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_consecutive",
)
CASES = {
    "tiny": (QUICK, [Workload("GPT-2", 8, 2), Workload("GPT-2 untied", 8, 2)]),
    "small": (FULL, [Workload("GPT-2", 128, 16), Workload("GPT-2 untied", 128, 16)]),
    # GPT-2 small at its real size, as on the H100 (minutes a method on 2 cores)
    "gpt2-small": (GPT2_SMALL, [Workload("GPT-2", 128, 16)]),
}


def build(method: str, workload: Workload, config: Config) -> Any:
    """The step of ``method``: a callable taking no argument."""
    import torch

    torch.manual_seed(0)
    model = hf_model(workload.model, config, workload.length).train()
    inputs, targets = batch(workload, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    size = workload.batch_size
    if method == "non-private":
        from benchmarks.dp_transformers import loss_fn

        def plain_step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(**inputs), targets).backward()
            optimizer.step()

        return plain_step
    if method.startswith("pergrad"):
        return pergrad_step(model, optimizer, inputs, targets, size, 1.0).call
    return opacus_step("Opacus hooks", model, optimizer, inputs, targets, workload, 1.0).call


def profile(step: Any, sites: int, warmup: int, timed: int) -> dict[str, Any]:
    """One step's counts (after ``warmup`` steps), its top sync sites, the median time of
    ``timed`` steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from pergrad.bench.host_syncs import HostSyncs

    for _ in range(warmup):
        step()
    times = []
    for _ in range(timed):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    leaves = sum(not any(c.name.startswith("aten::") for c in e.cpu_children) for e in events)
    profiled = sum(e.name in PROFILED_SYNCS for e in events)
    with HostSyncs(frames=3, within="pergrad") as syncs:
        step()
    return {
        "ms": 1e3 * statistics.median(times),
        "aten_ops": leaves,
        "profiled_syncs": profiled,
        "syncs": syncs.count,
        "dispatched_ops": syncs.ops,
        "sites": syncs.top_sites(sites),
    }


def methods(legacy: bool, only: str | None) -> list[str]:
    pergrad = ["pergrad DP (before)", "pergrad DP"] if legacy else ["pergrad DP"]
    chosen = ["non-private", *pergrad, "Opacus hooks"]
    return chosen if only is None else [m for m in chosen if m in only.split(",")]


def run(
    method: str, workload: Workload, config: Config, args: argparse.Namespace
) -> dict[str, Any]:
    from pergrad._src.capture import cost

    cost.DEFERRED_READS = method != "pergrad DP (before)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return profile(build(method, workload, config), args.sites, args.warmup, args.timed)
    except Exception as error:  # a method that cannot take the model is a result
        return {"failed": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"}
    finally:
        cost.DEFERRED_READS = True


def table(rows: list[dict[str, Any]]) -> str:
    columns = ["config", "workload", "method", "step ms", "aten ops (profiler)"]
    columns += ["scalar reads (profiler)", "host syncs (HostSyncs)", "kernels (HostSyncs)"]
    cells = [
        [r["config"], r["workload"], r["method"], fmt(r.get("ms"), ".0f", missing="—")]
        + [str(r.get(k, "—")) for k in ("aten_ops", "profiled_syncs", "syncs", "dispatched_ops")]
        for r in rows
    ]
    return markdown_table(columns, cells)


def site_lines(rows: list[dict[str, Any]]) -> str:
    lines = ["Top call sites of the host syncs (pergrad's frames, innermost first):", ""]
    for r in rows:
        if r["method"].startswith("pergrad") and r.get("sites") is not None:
            lines.append(f"- {r['config']} {r['workload']}, {r['method']}: {r['syncs']} syncs")
            lines += [f"  - {times}x `{op}` at {stack}" for op, stack, times in r["sites"]]
    return "\n".join(lines)


def header(args: argparse.Namespace) -> str:
    import torch

    return sentence_header(
        "Host syncs and aten ops of one DP step (CPU)",
        ["torch", "transformers", "opacus"],
        [
            f"torch threads {torch.get_num_threads()}",
            f"{args.warmup} warm-up steps, time the median of {args.timed}",
            f"load average {machine.load_average()} at the end",
            f"command `{machine.command_line()}`",
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs", default="tiny,small", help="comma-separated: tiny, small, gpt2-small"
    )
    parser.add_argument("--models", default="GPT-2,GPT-2 untied")
    parser.add_argument("--sites", type=int, default=6, help="top sync sites shown per step")
    parser.add_argument(
        "--legacy-syncs",
        action="store_true",
        help="also pergrad's step with the host reads of before this change",
    )
    parser.add_argument("--methods", help="only these, comma-separated (e.g. 'pergrad DP')")
    parser.add_argument(
        "--warmup", type=int, default=WARMUP_STEPS, help="steps before the counted ones (>= 2)"
    )
    parser.add_argument("--timed", type=int, default=TIMED_STEPS, help="steps timed")
    parser.add_argument("--out", type=Path, help="write the markdown here")
    args = parser.parse_args()
    rows = []
    for name in args.configs.split(","):
        config, chosen = CASES[name]
        for workload in chosen:
            if workload.model not in args.models.split(","):
                continue
            for method in methods(args.legacy_syncs, args.methods):
                found = run(method, workload, config, args)
                rows.append({"config": name, "workload": workload.name, "method": method, **found})
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    publish(table(rows) + "\n\n" + site_lines(rows), args.out, lambda: header(args))


if __name__ == "__main__":
    main()
