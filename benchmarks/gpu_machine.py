"""The machine header of a GPU run, and the summary of its tests (scripts/gpu_check.sh, issue 38).

Run:  python -m benchmarks.gpu_machine [--device cuda] --out machine.md
      python -m benchmarks.gpu_machine --tests-log logs/tests.log --out tests.md

The header names the GPU, its memory and driver, CUDA and cuDNN as torch sees them, the CPU and
its load, and the versions of Python, torch, JAX (and the devices it sees), the peers and
pergrad. The tests' summary counts a pytest log's outcomes (``-v`` lines, with or without
xdist) and lists the tests that failed, with pytest's own last line.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
from pathlib import Path

from pergrad.bench.machine import cpu_and_cores, load_average, software, today
from pergrad.bench.report import write_text

PACKAGES = ("torch", "jax", "jaxlib", "transformers", "opacus", "dp-accounting", "jax-privacy")
OUTCOME = re.compile(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def nvidia_smi() -> str:
    query = "name,memory.total,driver_version,clocks.max.sm,power.limit"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return f"nvidia-smi: not available ({type(error).__name__})"
    return f"nvidia-smi ({query}): {done.stdout.strip()}"


def header(device: str) -> str:
    import torch

    lines = [f"- CPU: {cpu_and_cores()}; load average {load_average()}", f"- {nvidia_smi()}"]
    if device != "cpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        lines.append(
            f"- torch sees: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
            f"{props.multi_processor_count} multiprocessors, compute capability "
            f"{props.major}.{props.minor}; CUDA {torch.version.cuda}, "
            f"cuDNN {torch.backends.cudnn.version()}"
        )
    else:
        lines.append(f"- torch device: {device} (no GPU)")
    try:
        import jax

        lines.append(f"- JAX devices: {', '.join(str(d) for d in jax.devices())}")
    except Exception as error:  # JAX missing or without a backend: the header says so
        lines.append(f"- JAX: {type(error).__name__}: {error}")
    lines.append(f"- versions: {software(*PACKAGES)}")
    lines.append(f"- date: {today()}")
    return "# The machine of this run\n\n" + "\n".join(lines) + "\n"


def tests_summary(log: Path) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    counts: collections.Counter[str] = collections.Counter()
    failed = []
    for line in text.splitlines():
        if "::" not in line or not (match := OUTCOME.search(line)):
            continue
        counts[match.group(1)] += 1
        if match.group(1) in ("FAILED", "ERROR"):
            failed.append(line.strip())
    last = [line for line in text.splitlines() if re.match(r"=+ .*\d+ (passed|failed)", line)]
    lines = [
        "# The device subset of the suite (pytest -m 'device and not slow')\n",
        f"Outcomes: {', '.join(f'{k} {v}' for k, v in sorted(counts.items())) or 'none read'}.",
        f"pytest's summary: {last[-1] if last else '(none: the run was stopped before its end)'}\n",
    ]
    if failed:
        lines += ["Failed:\n", *(f"- `{line[:300]}`" for line in failed)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tests-log", type=Path, help="summarise this pytest log instead")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    text = tests_summary(args.tests_log) if args.tests_log else header(args.device)
    write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
