"""The benchmark command (``python -m pergrad.bench``, shipped in the package) runs, and every
available method agrees with the loop."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("torch")
pytest.importorskip("jax")


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory) -> tuple[dict, Path]:
    """A quick run as a pip user makes it: from a folder outside the repository."""
    out = tmp_path_factory.mktemp("bench")
    command = [sys.executable, "-m", "pergrad.bench", "--quick", "--out", str(out)]
    subprocess.run(command, cwd=out, check=True, capture_output=True, timeout=300)
    return json.loads((out / "results.json").read_text()), out


def test_quick_run_writes_results(quick_results) -> None:
    import torch

    results, out = quick_results
    text = (out / "results.md").read_text()
    assert text.startswith("# pergrad benchmarks")
    assert "| / floor | / floor of its kind | speed-up over loop |" in text
    assert (out / "ratio_to_floor.png").exists()
    assert (out / "time_vs_batch_size.png").exists()
    assert results["machine"]["cores"] and results["run"]["mode"] == "quick"
    default = "cuda" if torch.cuda.is_available() else "cpu"  # the default device
    assert results["run"]["device"] == default
    assert results["machine"]["device"].startswith(default)
    assert f"- device: torch on {results['machine']['device']}; JAX on " in text
    assert results["run"]["command"].startswith("python -m pergrad.bench --quick")


def test_every_available_method_has_rows_that_agree_with_the_loop(quick_results) -> None:
    from pergrad.bench.methods import METHODS

    results, _ = quick_results
    skipped = {s["method"] for s in results["skipped"]}
    ok_rows = [r for r in results["rows"] if r["status"] == "ok"]
    for method in METHODS:
        if method.name not in skipped:
            assert any(r["method"] == method.name for r in ok_rows), method.name
    for row in ok_rows:
        if row["kind"] != "write":  # the write of B x P numbers computes nothing to check
            assert math.isfinite(row["max_abs_err"]) and row["max_abs_err"] < 1e-3, row
        assert row["median_ms"] > 0
    workloads = {r["workload"] for r in results["rows"]}
    assert workloads == {"cnn", "mlp", "linreg", "transformer", "sweep"}


def test_ratios_to_the_floors_and_to_each_frameworks_loop(quick_results) -> None:
    from pergrad.bench.methods import LOOPS

    results, _ = quick_results
    rows = [r for r in results["rows"] if r["status"] == "ok"]
    for row in rows:
        times = row["times_ms"]
        same_call = [
            r
            for r in rows
            if (r["workload"], r["batch_size"]) == (row["workload"], row["batch_size"])
        ]
        by_method = {r["method"]: r["times_ms"] for r in same_call}
        floor = by_method[f"{row['framework']} batch grad (floor)"]
        write = by_method[f"{row['framework']} write B×P"]
        loop = by_method[LOOPS[row["framework"]]]
        if row["kind"] == "grads":
            expected = statistics.median(t / (b + w) for t, b, w in zip(times, floor, write))
        elif row["kind"] == "norms":
            expected = statistics.median(t / b for t, b in zip(times, floor))
        else:
            expected = None
        assert row["ratio_to_kind_floor"] == pytest.approx(expected), row
        if row["kind"] == "write":
            assert row["speedup_over_loop"] is None, row
        else:  # against the loop of its own framework
            speedup = statistics.median(lp / t for lp, t in zip(loop, times))
            assert row["speedup_over_loop"] == pytest.approx(speedup), row


def test_memory_plot_of_the_sweep(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from pergrad.bench.report import plot_memory_sweep

    rows = [
        {"workload": "sweep", "status": "ok", "method": m, "framework": fw, "batch_size": b}
        | {"peak_mib": mib}
        for (m, fw), per_size in {("a", "torch"): [0.0, 0.5, 4.0], ("b", "jax"): [1, 8, 64]}.items()
        for b, mib in zip((8, 32, 128), per_size)
    ]
    plot_memory_sweep(rows, tmp_path / "memory_vs_batch_size.png")
    assert (tmp_path / "memory_vs_batch_size.png").stat().st_size > 0
    plot_memory_sweep([r | {"peak_mib": None} for r in rows], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()  # nothing measured: no plot


def test_memory_probe_runs_in_a_subprocess() -> None:
    from pergrad.bench.memory import measure

    result = measure("linreg", "torch loop", 32)
    assert result["peak_mib"] is not None and result["peak_mib"] >= 0, result


def test_memory_probe_of_several_batch_sizes_in_one_subprocess() -> None:
    from pergrad.bench.memory import measure_sizes

    by_size = measure_sizes("sweep", "torch write B×P", (8, 512))
    assert set(by_size) == {8, 512}
    assert all(r["peak_mib"] is not None for r in by_size.values()), by_size
    # 512 examples of an MLP with 34k parameters: 512 x 34k float32 numbers, 66 MiB
    assert by_size[512]["peak_mib"] > 50 > by_size[8]["peak_mib"], by_size


def test_results_go_under_the_working_directory_by_default(monkeypatch) -> None:
    """A pip user's results land in ./pergrad-bench-results/<device>, never in site-packages;
    the repository's `python -m benchmarks` keeps writing to benchmarks/results/<device>."""
    from pergrad.bench.cli import parse_args

    args = parse_args(["--device", "cpu"])
    assert args.out == Path("pergrad-bench-results") / "cpu" and not args.out.is_absolute()
    assert args.device.type == "cpu"
    repository = parse_args(["--device", "cpu"], "python -m benchmarks", REPO_ROOT / "results")
    assert repository.out == REPO_ROOT / "results" / "cpu"
    assert parse_args(["--device", "cpu", "--out", "x"]).out == Path("x")


def test_an_unusable_device_is_a_usage_error_that_says_why(capsys) -> None:
    import torch

    from pergrad.bench.cli import parse_args

    with pytest.raises(SystemExit) as raised:
        parse_args(["--device", "tpu"])
    assert raised.value.code == 2
    assert "--device: expected cpu, cuda or cuda:N, got 'tpu'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            parse_args(["--device", "cuda"])
        assert "sees no GPU" in capsys.readouterr().err


def test_a_missing_peer_is_skipped_with_a_note(monkeypatch, capsys) -> None:
    import importlib.util

    import torch

    from pergrad.bench.cli import available_methods

    find_spec = importlib.util.find_spec
    absent = {"opacus", "jax"}
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in absent else find_spec(name, *a),
    )
    methods, skipped, jax_device = available_methods(torch.device("cpu"))
    assert jax_device is None
    assert all(m.framework == "torch" and "opacus" not in m.requires for m in methods)
    reasons = {s["method"]: s["reason"] for s in skipped}
    assert reasons["opacus GradSampleModule"] == "missing opacus"
    assert reasons["pergrad (jax, jit)"] == "missing jax"
    assert "note: skipping 'opacus ghost norms': missing opacus" in capsys.readouterr().err


def test_without_torch_the_command_says_it_needs_torch() -> None:
    hide_torch = "import sys; sys.modules['torch'] = None; from pergrad.bench import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", hide_torch], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "pergrad.bench needs PyTorch, which is not installed" in done.stderr


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_torch_methods_run_on_the_device_of_the_model() -> None:
    """Every torch method moves the batch to the model's device and makes its own tensors there
    (the meta device: shapes only, so this runs anywhere; `--device cuda` takes the same path)."""
    import torch

    from pergrad.bench.methods import METHODS
    from pergrad.bench.workloads import WORKLOADS, build

    # pergrad's ghost norms check the captured layout numerically on their first call.
    reads_values = {"pergrad norms (torch)"}
    workload = WORKLOADS["mlp"]
    for method in METHODS:
        if method.framework != "torch" or method.missing() or method.name in reads_values:
            continue
        model, x, y = build(workload, 2, torch.device("meta"))
        result = method.build(workload, model, x, y)()
        tensors = result.values() if isinstance(result, dict) else [result]
        assert {t.device.type for t in tensors} == {"meta"}, method.name


def test_the_repository_command_is_a_thin_alias() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m benchmarks")
    assert "benchmarks/results" in done.stdout.replace("\n", "").replace(" ", "")


@pytest.mark.slow(reason="a subprocess quick run of the hooks-against-vmap benchmark: ~15 s")
def test_hooks_vs_vmap_benchmark_quick_run(tmp_path) -> None:
    """benchmarks/hooks_vs_vmap.py --quick: a row per workload, with a positive ratio."""
    out = tmp_path / "hooks_vs_vmap.md"
    command = [sys.executable, "benchmarks/hooks_vs_vmap.py", "--quick", "--out", str(out)]
    subprocess.run(command, check=True, cwd=REPO_ROOT, capture_output=True, timeout=600)
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")][2:]
    assert [row.split(" | ")[0] for row in rows] == [
        "| linreg (B=8)",
        "| mlp (B=8)",
        "| cnn (B=8)",
        "| transformer (B=8)",
    ]
    assert all(float(row.split(" | ")[-1].rstrip(" |x")) > 0 for row in rows)


@pytest.mark.slow(
    reason="a subprocess quick run of the strategies benchmark: about 20 s on 2 CPU cores"
)
def test_strategies_benchmark_quick_run(tmp_path) -> None:
    """benchmarks/strategies.py --quick: every strategy that runs agrees with the loop, and the
    models vmap cannot batch take the hooks."""
    pytest.importorskip("transformers", reason="the strategies benchmark runs Hugging Face models")
    out = tmp_path / "strategies.md"
    command = [sys.executable, "benchmarks/strategies.py", "--quick", "--out", str(out)]
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    text = out.read_text()
    assert text.startswith("# Per-example gradient strategies")
    lines = [line for line in text.splitlines() if line.startswith("| ")][2:]  # no header rows
    rows = [line.split("|")[1:-1] for line in lines]
    rows = [[cell.strip() for cell in row] for row in rows]
    assert {r[0] for r in rows} == {
        "GPT-2",
        "GPT-2 + checkpointing",
        "BERT",
        "BERT + checkpointing",
    }
    for model, method, taken, _, _, _, flops, error in rows:
        if method == "hooks":  # a checked layout's later calls form no weight gradient
            assert float(flops.rstrip("x")) < 1.1, (model, flops)
        if method == "auto":
            assert taken in ("vmap", "hooks"), (model, taken)
        if error != "—":
            assert float(error) < 1e-4, (model, method, error)


@pytest.mark.slow(
    reason="a subprocess quick run of five transformer workloads: about 11 s on 2 CPU cores"
)
def test_dp_transformers_benchmark_quick_run(tmp_path) -> None:
    """benchmarks/dp_transformers.py --quick: every model and method has a row, Opacus's ghost
    clipping refuses GPT-2's tied embedding (reported, not untied), pergrad's rows name the
    strategy its DP step took (T5, with its relative attention bias: ghost), and the plot is
    written."""
    pytest.importorskip("transformers", reason="the DP benchmark runs Hugging Face models")
    pytest.importorskip("opacus", reason="the DP benchmark compares with Opacus")
    out = tmp_path / "dp_transformers.md"
    command = [sys.executable, "benchmarks/dp_transformers.py", "--quick", "--out", str(out)]
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    text = out.read_text()
    assert text.startswith("# DP-SGD step cost on small transformers")
    assert "- machine: " in text and "opacus " in text
    lines = [line for line in text.splitlines() if line.startswith("| ")][2:]  # no header rows
    rows = {}
    for line in lines:
        workload, method, strategy, ms, ratio, _, _, _, working, extra, note = (
            cell.strip() for cell in line.split("|")[1:-1]
        )
        rows[(workload.split(" T=")[0], method)] = (strategy, ms, ratio, extra, note, working)
    models = {"GPT-2", "BERT", "Llama", "T5", "ViT"}
    methods = {"non-private", "pergrad DP", "pergrad low-memory", "Opacus hooks", "Opacus ghost"}
    assert set(rows) == {(model, method) for model in models for method in methods}
    assert rows[("GPT-2", "Opacus ghost")][4].startswith("refuses: NotImplementedError")
    for model in models:
        assert rows[(model, "non-private")][2:4] == ("1.00x", "1.00x")
        # the tiny models' later steps need next to no working memory: its ratio may be "—"
        assert rows[(model, "non-private")][5] in ("1.00x", "—")
        strategy, ms, ratio, extra, note, working = rows[(model, "pergrad DP")]
        assert strategy in ("ghost", "chunked", "materialize") and not note, (model, note)
        assert float(ms) > 0 and ratio.endswith("x") and extra.endswith("x")
        assert working.endswith("x") or working == "—"
        assert rows[(model, "pergrad low-memory")][0] == "ghost-lowmem", model
    assert rows[("T5", "pergrad DP")][0] == "ghost"
    assert "pergrad's DP step within 1.15x the time and 1.1x the memory" in text
    text_lines = text.splitlines()
    start = next(i for i, line in enumerate(text_lines) if line.startswith("- The same step"))
    differences = []
    for line in text_lines[start + 1 :]:
        if not line.startswith("  - "):
            break
        differences.append(line[4:])
    # 6 models x (pergrad low-memory, 2 Opacus modes), the clip share
    assert len(differences) == 19, differences
    for entry in differences[:-1]:
        name, value = entry.split(": ", 1)
        if name in ("GPT-2 / Opacus ghost", "T5 / Opacus ghost"):  # tied tables
            assert value.startswith("refuses"), value
        elif name == "T5 / Opacus hooks":  # its relative-bias lookup has no batch axis
            assert value.startswith("fails"), value
        else:  # the same DP step, to float32 rounding
            assert float(value) < 1e-4, entry
    assert (tmp_path / "dp_transformers.png").stat().st_size > 0


@pytest.mark.slow(reason="a subprocess profile of tiny GPT-2 steps: about 10 s on 2 CPU cores")
def test_dp_step_profile_quick_run(tmp_path) -> None:
    """benchmarks/dp_step_profile.py on the tiny GPT-2: a row per method, pergrad's DP step
    with its two host syncs (the norms' flags, the step's statistics) against more before,
    none in the non-private step, and pergrad's sync sites listed."""
    pytest.importorskip("transformers", reason="the profile runs Hugging Face models")
    pytest.importorskip("opacus", reason="the profile compares with Opacus")
    out = tmp_path / "dp_step_profile.md"
    command = [sys.executable, "benchmarks/dp_step_profile.py", "--configs", "tiny"]
    command += ["--models", "GPT-2", "--legacy-syncs", "--out", str(out)]
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    text = out.read_text()
    assert text.startswith("# Host syncs and aten ops of one DP step (CPU)")
    rows = {
        cells[2]: cells
        for line in text.splitlines()
        if line.startswith("| tiny ")
        for cells in [[c.strip() for c in line.split("|")[1:-1]]]
    }
    assert set(rows) == {"non-private", "pergrad DP (before)", "pergrad DP", "Opacus hooks"}
    syncs = {method: int(cells[6]) for method, cells in rows.items()}
    assert syncs["non-private"] == 0
    assert syncs["pergrad DP"] == 2 < syncs["pergrad DP (before)"]
    assert "at pergrad/_src/torch/dp_step.py" in text


@pytest.mark.slow(reason="a subprocess run of the small ViT's steps, 1 round: about 10 s")
def test_dp_time_split_counts_the_phases_and_their_flops(tmp_path) -> None:
    """benchmarks/dp_time_split.py on the ViT: each phase timed, and the FLOP table: the DP
    step does the non-private step's products and its norms' on top (so more FLOPs), its
    norms' FLOPs counted (not 0), and a rate for each phase."""
    pytest.importorskip("transformers", reason="the split runs Hugging Face models")
    out = tmp_path / "dp_time_split.md"
    command = [sys.executable, "benchmarks/dp_time_split.py", "--models", "ViT"]
    command += ["--rounds", "1", "--out", str(out)]
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    text = out.read_text()
    assert text.startswith("# The DP step's time, phase by phase (CPU)")
    phases = [line for line in text.splitlines() if line.startswith("| ViT T=65 B=32 | pergrad")]
    assert len(phases) == 1 and all(cell.strip() for cell in phases[0].split("|")[3:8])
    (row,) = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in text.split("The matrix products' work")[1].splitlines()
        if line.startswith("| ViT")
    ]
    plain, dp, norms = (float(cell.split()[0]) for cell in row[1:4])
    assert norms > 0 and dp > plain + 0.9 * norms
    assert all(float(rate) > 0 for rate in row[5:8])


@pytest.mark.slow(
    reason="a subprocess quick run that compiles JAX transformer steps: about 35 s on 2 CPU cores"
)
def test_dp_transformers_jax_benchmark_quick_run(tmp_path) -> None:
    """benchmarks/dp_transformers_jax.py --quick: every method has a row, pergrad's ghost step
    names its strategy, every private gradient agrees with the hand-written vmap step's without
    noise, and jax-privacy is measured or said to be missing."""
    pytest.importorskip("flax", reason="the JAX DP benchmark runs flax models")
    pytest.importorskip("optax", reason="the JAX DP benchmark's steps are optax updates")
    out = tmp_path / "dp_transformers_jax.md"
    command = [sys.executable, "benchmarks/dp_transformers_jax.py", "--quick", "--out", str(out)]
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    text = out.read_text()
    assert text.startswith("# DP-SGD step cost on small JAX transformers")
    assert "- machine: " in text and "load average" in text
    lines = [line for line in text.splitlines() if line.startswith("| ")][2:]  # no header rows
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        rows[(cells[0], cells[1])] = cells[2:]
    methods = [
        "non-private",
        "pergrad ghost",
        "pergrad auto",
        "pergrad optax",
        "vmap by hand",
        "jax-privacy",
    ]
    assert list(rows) == [("flax linen", method) for method in methods]
    strategy, ms, ratio, _, _, memory, _, temp_ratio, note = rows[("flax linen", "non-private")]
    assert (ratio, memory, temp_ratio, note) == ("1.00x", "1.00x", "1.00x", "")
    for method in ("pergrad ghost", "pergrad optax", "vmap by hand"):
        strategy, ms, ratio, _, _, memory, _, temp_ratio, note = rows[("flax linen", method)]
        assert not note and float(ms) > 0, (method, note)
        assert ratio.endswith("x") and memory.endswith("x") and temp_ratio.endswith("x")
    assert rows[("flax linen", "pergrad ghost")][0] == "ghost"
    assert rows[("flax linen", "pergrad auto")][0] in ("ghost", "chunked", "materialize")
    peer_note = rows[("flax linen", "jax-privacy")][-1]
    assert peer_note == "" or peer_note.startswith("not installed"), peer_note
    agreement = next(line for line in text.splitlines() if line.startswith("  - flax linen: "))
    differences = dict(entry.rsplit(" ", 1) for entry in agreement[16:].split(", "))
    assert {"pergrad ghost", "pergrad optax"} <= set(differences), agreement
    assert all(float(value) < 1e-4 for value in differences.values()), agreement
    assert "pergrad's DP step within 1.15x the time and 1.1x the memory" in text


@pytest.mark.slow(
    reason="a subprocess quick run that starts 1 then 2 gloo processes, each importing torch, "
    "transformers and Opacus: 59 s on the shared 2-core machine (30 s of CPU)"
)
def test_fsdp_memory_benchmark_quick_run(tmp_path) -> None:
    """benchmarks/fsdp_memory.py --quick: every method has a row for 1 and 2 processes,
    pergrad's step on the sharded model takes the FSDP path, each of 2 processes holds half of
    one process's state, and the DP methods' noiseless updates equal one process's on the
    union of the batches (Opacus's, or the reason it did not run)."""
    import re

    import torch

    pytest.importorskip("transformers", reason="the FSDP benchmark runs a Hugging Face GPT-2")
    pytest.importorskip("opacus", reason="the FSDP benchmark compares with Opacus")
    if not torch.distributed.is_available():
        pytest.skip("this PyTorch build has no torch.distributed")
    out = tmp_path / "fsdp_memory.md"
    command = [sys.executable, "benchmarks/fsdp_memory.py", "--quick", "--out", str(out)]
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    text = out.read_text()
    assert text.startswith("# DP-SGD on a GPT-2 sharded with FSDP2")
    assert "- uptime at the start: " in text and "opacus " in text
    lines = [line for line in text.splitlines() if line.startswith("| ")][2:]  # no header rows
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        rows[(cells[0], cells[1])] = cells
    methods = ("non-private", "pergrad DP", "Opacus ghost")
    assert set(rows) == {(world, method) for world in ("1", "2") for method in methods}
    assert rows[("1", "pergrad DP")][-1].startswith("strategy ghost,")
    assert rows[("2", "pergrad DP")][-1].startswith("strategy ghost-fsdp,")
    for method in ("non-private", "pergrad DP"):
        _, _, ms, time_ratio, state, state_ratio, *_ = rows[("2", method)]
        assert float(ms) > 0 and time_ratio.endswith("x") and float(state) > 0
        assert 0.45 <= float(state_ratio.split("x")[0]) <= 0.55, state_ratio  # 1/N of N=1's
    agreement = next(line for line in text.splitlines() if line.startswith("- N=2: whole"))
    differences = dict(re.findall(r"(pergrad DP|Opacus ghost) (\d\.\de[+-]\d+)", agreement))
    assert float(differences["pergrad DP"]) < 1e-4, agreement
    assert "Opacus ghost did not run" in agreement or float(differences["Opacus ghost"]) < 1e-3


@pytest.mark.slow  # compiles four sharded programs (about 25 s on 2 cores)
def test_fsdp_memory_jax_benchmark_quick_run(tmp_path) -> None:
    """benchmarks/fsdp_memory_jax.py --quick: both steps on 1 and 2 devices, the parameters per
    device halved on 2, XLA's per-device account in every row."""
    pytest.importorskip("flax", reason="the JAX FSDP benchmark runs a flax model")
    out = tmp_path / "fsdp_memory_jax.md"
    command = [sys.executable, "-m", "benchmarks.fsdp_memory_jax", "--quick", "--out", str(out)]
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    rows = {}
    for line in out.read_text().splitlines()[2:]:
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if cells and cells[0].isdigit():
            rows[(cells[0], cells[1])] = [float(c) for c in cells[2:]]
    assert set(rows) == {(n, step) for n in ("1", "2") for step in ("non-private", "pergrad DP")}
    for step in ("non-private", "pergrad DP"):
        one, two = rows[("1", step)][0], rows[("2", step)][0]
        assert 0.4 <= two / one <= 0.6, (step, one, two)  # 1/N of the parameters per device
        assert all(value > 0 for value in rows[("2", step)])


def test_the_bergson_comparison_without_bergson_says_how_to_install_it() -> None:
    import importlib.util

    if importlib.util.find_spec("bergson") is not None:
        pytest.skip("bergson is installed here: the script would run its comparison")
    command = [sys.executable, "benchmarks/metagradient_bergson.py", "--quick"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "needs bergson" in result.stderr and "pip install --no-deps bergson" in result.stderr


def test_the_flop_count_of_products_and_of_a_conds_branches() -> None:
    """benchmarks/dp_flops_jax.py's count: 2 m k n for an (m, k) @ (k, n) product (closed
    form), a batched one times its batch, a cond by its cheapest / dearest branch."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from benchmarks.dp_flops_jax import matmul_flops

    def f(x, w, ys, flag):
        out = x @ w  # (3, 4) @ (4, 5): 2 * 3 * 4 * 5
        batched = jnp.einsum("btk,bkf->btf", ys, ys)  # 2 x (2, 2) @ (2, 2), batch 2: 2*2*2*2*2
        return jax.lax.cond(flag, lambda: (out @ w.T).sum(), lambda: out.sum()) + batched.sum()

    args = (jnp.ones((3, 4)), jnp.ones((4, 5)), jnp.ones((2, 2, 2)), True)
    usual, worst = matmul_flops(jax.make_jaxpr(f)(*args).jaxpr)
    assert usual == 2 * 3 * 4 * 5 + 2 * 2 * 2 * 2 * 2
    assert worst == usual + 2 * 3 * 5 * 4  # (3, 5) @ (5, 4) in the dearer branch
