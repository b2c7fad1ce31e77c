"""The CPU dry run of scripts/gpu_check.sh (issue 38): every part of the GPU run, on tiny
sizes, so that the script a lent GPU machine runs once cannot rot between loans."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("machine", "costs", "dp", "bench", "tests")

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("opacus")


@pytest.mark.slow(
    reason="about 40 s on 2 cores (five subprocesses importing torch and jax); run it before "
    "a GPU session's first call, as tests/README.md says"
)
def test_the_dry_run_writes_every_part_and_ships_it(tmp_path: Path) -> None:
    results, out = tmp_path / "results", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "JAX_PLATFORMS": "cpu"}
    command = ["bash", "scripts/gpu_check.sh", "--device", "cpu", "--quick"]
    command += ["--results", str(results), "--python", sys.executable]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (results / "summary.md").read_text()
    for part in PARTS:
        assert f"| {part} | ok |" in summary, summary
    assert "torch" in (results / "machine.md").read_text()
    assert "| GPT-2 T=8 B=2 | pergrad DP |" in (results / "dp_device.md").read_text()
    assert "SYNC_COST" in (results / "device_costs.md").read_text()
    assert "pergrad (torch)" in (results / "bench" / "results.md").read_text()
    assert "Outcomes:" in (results / "tests.md").read_text()
    with tarfile.open(out / "gpu_results.tar.gz") as shipped:
        names = set(shipped.getnames())
    assert f"{results.name}/dp_device.md" in names and f"{results.name}/logs/tests.log" in names
    assert (out / "summary.md").read_text() == summary


def test_an_unknown_part_is_refused_with_the_choices() -> None:
    command = ["bash", "scripts/gpu_check.sh", "--device", "cpu", "--parts", "costs gpu"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "expected some of 'costs dp bench tests', got gpu" in done.stderr
