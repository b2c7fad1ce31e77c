"""The benchmark command runs, and every available method agrees with the loop."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("torch")
pytest.importorskip("jax")


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    command = [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)]
    subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True, timeout=300)
    return json.loads((out / "results.json").read_text()), out


def test_quick_run_writes_results(quick_results) -> None:
    results, out = quick_results
    assert (out / "results.md").read_text().startswith("# pergrad benchmarks")
    assert (out / "ratio_to_floor.png").exists()
    assert (out / "time_vs_batch_size.png").exists()
    assert results["machine"]["cores"] and results["run"]["mode"] == "quick"


def test_every_available_method_has_rows_that_agree_with_the_loop(quick_results) -> None:
    sys.path.insert(0, str(REPO_ROOT))  # opacus installs a top-level `benchmarks` package too
    from benchmarks.methods import METHODS

    results, _ = quick_results
    skipped = {s["method"] for s in results["skipped"]}
    ok_rows = [r for r in results["rows"] if r["status"] == "ok"]
    for method in METHODS:
        if method.name not in skipped:
            assert any(r["method"] == method.name for r in ok_rows), method.name
    for row in ok_rows:
        assert math.isfinite(row["max_abs_err"]) and row["max_abs_err"] < 1e-3, row
        assert row["median_ms"] > 0
    workloads = {r["workload"] for r in results["rows"]}
    assert workloads == {"cnn", "mlp", "linreg", "transformer", "sweep"}


def test_memory_probe_runs_in_a_subprocess() -> None:
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.memory import measure

    result = measure("linreg", "torch loop", 32)
    assert result["peak_mib"] is not None and result["peak_mib"] >= 0, result


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
    for model, method, taken, _, _, _, error in rows:
        if method == "auto":
            assert taken in ("vmap", "hooks"), (model, taken)
        if error != "—":
            assert float(error) < 1e-4, (model, method, error)
