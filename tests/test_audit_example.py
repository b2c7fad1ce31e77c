"""examples/audit_dp_sgd.py runs and reaches its verdicts: correct DP-SGD passes, breaks are caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "audit_dp_sgd.py"


@pytest.mark.slow(reason="seven DP-SGD training runs on digits, about 15 s on 2 CPU cores")
def test_audit_example_passes_correct_dp_sgd_and_catches_the_breaks():
    pytest.importorskip("sklearn", reason="the example uses scikit-learn's bundled digits")
    pytest.importorskip("jax", reason="the example trains with JAX")
    pytest.importorskip("dp_accounting", reason="the claims come from dp-accounting")
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ")]
    verdicts = {(row[0].strip(), row[1].strip()): row for row in rows[2:]}
    assert set(verdicts) == {
        ("correct", "1"),
        ("correct", "2"),
        ("no noise", "2"),
        ("no clipping (canaries of norm 100)", "2"),
        ("noise per micro-batch (64, std / 64 each)", "2"),
        ("noise over the batch size (std / B, on the sum)", "2"),
    }
    for (name, _), row in verdicts.items():
        claimed, bound = float(row[2]), float(row[3])
        if name == "correct":
            assert bound < claimed and row[6].strip() == "passes"
        else:
            assert bound > claimed and row[6].strip() == "VIOLATED"
