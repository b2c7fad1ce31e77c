"""The runnable examples run and say what they promise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def fast_compile_env() -> dict[str, str]:
    """The environment for an example whose run is mostly XLA compiling small JAX steps: JAX
    without XLA's backend optimisations compiles them in about half the time (results change
    only by rounding), as the ``fast_xla_compile`` fixture does in this process. Not for an
    example whose steps run long (find_mislabeled, influence_digits, audit_dp_sgd): slower."""
    return os.environ | {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


def run_example(name: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_quickstart_checks_the_mean_on_both_backends():
    pytest.importorskip("jax", reason="the quickstart runs JAX")
    pytest.importorskip("torch", reason="the quickstart runs PyTorch")
    out = run_example("quickstart.py", fast_compile_env())
    lines = [line for line in out.splitlines() if "mean == batch gradient" in line]
    assert [line.split(":")[0].strip() for line in lines] == ["JAX", "PyTorch"]


def test_find_mislabeled_beats_the_random_baseline(tmp_path):
    pytest.importorskip("sklearn", reason="the example uses scikit-learn's bundled digits")
    pytest.importorskip("matplotlib", reason="the example saves a histogram")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "find_mislabeled.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split("|") for line in result.stdout.splitlines() if "gradient norm" in line]
    assert [row[1].strip() for row in rows] == ["PyTorch", "JAX"]
    for row in rows:
        precision, random_precision = float(row[4]), float(row[6])
        assert precision > 5 * random_precision
    assert (tmp_path / "mislabeled_norms.png").stat().st_size > 10_000


def test_dp_sgd_digits_quick_run_reports_the_target_epsilons():
    pytest.importorskip("sklearn", reason="the example uses scikit-learn's bundled digits")
    pytest.importorskip("dp_accounting", reason="the example calibrates noise with dp-accounting")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "dp_sgd_digits.py"), "--quick", "--seed", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=fast_compile_env(),
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ")]
    by_target = {row[0].strip(): [cell.strip() for cell in row[1:]] for row in rows[2:]}
    assert set(by_target) == {"1", "3", "8", "non-private"}
    for target in ("1", "3", "8"):
        spent = float(by_target[target][1])
        assert float(target) * 0.99 <= spent <= float(target) + 1e-6
    jax_accuracy, torch_accuracy = (float(v) for v in by_target["non-private"][2:])
    assert jax_accuracy > 0.5 and torch_accuracy > 0.5  # ten classes: chance is 0.1


def test_influence_digits_draws_helpful_and_harmful_training_digits(tmp_path):
    pytest.importorskip("sklearn", reason="the example uses scikit-learn's bundled digits")
    pytest.importorskip("matplotlib", reason="the example saves an image grid")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "influence_digits.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("test #")]
    assert len(rows) == 4
    for row in rows:  # the most helpful digits mostly carry the test digit's true label
        true_label = row.split("true ")[1].split(",")[0]
        helpful = row.split("most helpful training labels [")[1].split("]")[0].split(", ")
        assert helpful.count(true_label) >= 3
    assert (tmp_path / "influence_digits.png").stat().st_size > 10_000


def test_dp_finetune_gpt2_quick_run_learns_within_its_epsilon():
    pytest.importorskip("transformers", reason="the example trains a Hugging Face GPT-2")
    pytest.importorskip("dp_accounting", reason="the example calibrates noise with dp-accounting")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "dp_finetune_gpt2.py"), "--quick", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = {
        cells[0]: cells[1:]
        for cells in (
            [cell.strip() for cell in line.split("|")[1:-1]]
            for line in result.stdout.splitlines()
            if line.startswith("| ") and "---" not in line
        )
    }
    untrained = float(rows["untrained"][1])
    epsilon, private = float(rows["DP-SGD (pergrad)"][0]), float(rows["DP-SGD (pergrad)"][1])
    assert epsilon <= 8.0 + 1e-6
    assert float(rows["non-private"][1]) < private < untrained
    assert "pergrad strategy: ghost" in result.stdout  # the tied embedding / LM head stays fast
