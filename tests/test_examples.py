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
