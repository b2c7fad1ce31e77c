"""The runnable examples run and say what they promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_quickstart_checks_the_mean_on_both_backends():
    pytest.importorskip("jax", reason="the quickstart runs JAX")
    pytest.importorskip("torch", reason="the quickstart runs PyTorch")
    out = run_example("quickstart.py")
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
