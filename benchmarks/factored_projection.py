"""Factored (LoGra) projection vs materialise-then-project on a small GPT-2: time and memory.

Run:  python benchmarks/factored_projection.py [--quick] [--batch-size B] [--out PATH]

Workload (issue 21): a Hugging Face ``GPT2LMHeadModel`` built offline from a ``GPT2Config`` with
random initialisation, 4 layers, width 256, 4 heads, 128 tokens per sequence, a vocabulary of
2048 tokens (the materialised route draws ``P x D`` random numbers per call: GPT-2's 50257
tokens, P = 29 M untied, would make that 37 G numbers a batch) and an output layer of its own
(``tie_word_embeddings=False``). One
example is one sequence; its loss is its mean next-token cross-entropy. Every method turns a
batch of ``B`` sequences into ``(B, D)`` features of the same dimension ``D``:

* ``factored``: :func:`pergrad.influence.project_factored` with ``k_in = k_out = 8`` and
  ``other_dim = 128``: each ``Conv1D``, ``nn.Linear`` and ``nn.Embedding`` layer's ``8 x 8`` block
  from its input and output gradient, never forming its gradient; the biases and norms (the
  other parameters) projected densely to 128 columns. ``D = 64 x layers + 128``.
* ``materialise then project``: :func:`pergrad.per_example_grads`, ``(B, P)``, then
  :func:`pergrad.influence.project` to ``D`` columns (the dense projection of the full gradient,
  its ``(P, D)`` Gaussian matrix drawn block by block).
* ``factored, tied embeddings``: ``factored`` on the same model with the output layer tied to
  the token embedding, as GPT-2 ships: the tied table's block is the sum of its two uses'
  blocks, each in the table's own frame, so its ``B x V x width`` per-example gradient is never
  formed either (``D`` is smaller by one block: one table where there were two layers).

Each method runs in a FRESH Python process (:func:`pergrad.bench.child.run_in_child`;
``--quick``: all in this process), builds the model and the batch, reads the resident memory
(the baseline), runs once to warm up (the capture engine's first-call checks), resets the peak
(``/proc/self/clear_refs``), then runs ``--repeats`` times (default 1); it reports the median
seconds, examples per second and the peak resident memory (``VmHWM``) of the timed calls. Extra
memory = peak - baseline.
``--out PATH`` writes the table with the machine named.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from pergrad.bench.child import run_in_child
from pergrad.bench.machine import load_average
from pergrad.bench.memory import reset_peak, status_mib
from pergrad.bench.report import machine_sentence, markdown_table, publish
from pergrad.bench.timing import time_interleaved

METHODS = ("factored", "materialise then project", "factored, tied embeddings")
K_IN, K_OUT = 8, 8


@dataclass(frozen=True)
class Config:
    layers: int = 4
    width: int = 256
    heads: int = 4
    length: int = 128
    vocab: int = 2048
    other_dim: int = 128
    batch_size: int = 16


QUICK = Config(layers=2, width=32, heads=2, length=16, vocab=128, other_dim=16, batch_size=4)


def feature_dim(config: Config, tied: bool) -> int:
    """``D``: a ``K_IN x K_OUT`` block per Conv1D (4 a layer), the position embedding, the
    token embedding and, when untied, the output layer; then ``other_dim`` columns."""
    blocks = 4 * config.layers + (2 if tied else 3)
    return blocks * K_IN * K_OUT + config.other_dim


def build(config: Config, tied: bool) -> tuple[Any, tuple[Any, Any]]:
    """The per-example loss (a :func:`pergrad.module_loss`) and a batch ``(input_ids, labels)``."""
    import torch
    import torch.nn.functional as F
    import transformers

    import pergrad

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=config.vocab,
            n_positions=config.length,
            n_embd=config.width,
            n_layer=config.layers,
            n_head=config.heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=tied,
        )
    ).eval()

    def next_token_loss(output: Any, labels: Any) -> Any:
        logits = output.logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    generator = torch.Generator().manual_seed(1)
    shape = (config.batch_size, config.length)
    ids = torch.randint(0, config.vocab, shape, generator=generator)
    labels = torch.randint(0, config.vocab, shape, generator=generator)
    return pergrad.module_loss(model, next_token_loss), (ids, labels)


def featurizer(method: str, config: Config) -> Any:
    """``() -> (B, D) features`` for ``method``."""
    import pergrad
    from pergrad import influence

    tied = method == "factored, tied embeddings"
    loss, batch = build(config, tied)
    params = loss.params()
    dim = feature_dim(config, tied)
    if method == "materialise then project":
        grads_of = pergrad.per_example_grads(loss)
        return lambda: influence.project(grads_of(params, *batch), dim, seed=0)
    return lambda: influence.project_factored(
        loss, params, batch, k_in=K_IN, k_out=K_OUT, other_dim=config.other_dim, seed=0
    )


def worker(method: str, config: dict[str, int], repeats: int) -> dict[str, Any]:
    """Time and peak memory of one method, in this process (``config``: a ``Config``'s fields)."""
    import gc
    import warnings

    # torch.func's vmap over CPU attention falls back to a loop, with a warning per call
    warnings.filterwarnings("ignore", message="There is a performance drop")
    run = featurizer(method, Config(**config))
    gc.collect()
    baseline = status_mib("VmRSS")  # Python, torch, the model and the batch
    features = run()  # warm-up: the capture engine's first-call checks
    gc.collect()
    reset_peak()  # the peak of the timed calls only
    median = statistics.median(time_interleaved({method: run}, repeats, warmup=0)[method])
    return {
        "dim": int(features.shape[1]),
        "seconds": median,
        "examples_per_s": config["batch_size"] / median,
        "peak_mb": status_mib("VmHWM"),
        "baseline_mb": baseline,
    }


def measure(method: str, config: Config, repeats: int, fresh: bool) -> dict[str, Any]:
    """``worker``'s measurement, in a fresh process when ``fresh``, else in this one."""
    if not fresh:
        return worker(method, asdict(config), repeats)
    return run_in_child(worker, method, asdict(config), repeats)


def num_params(config: Config) -> int:
    loss, _ = build(Config(**{**asdict(config), "batch_size": 1}), tied=False)
    return sum(value.numel() for value in loss.params().values())


def table(results: dict[str, dict[str, Any]]) -> str:
    reference = results["materialise then project"]
    columns = ["method", "D", "seconds per batch", "examples/s", "vs materialise", "peak RSS MB"]
    columns.append("extra MB (peak - baseline)")
    rows = [
        [method, str(r["dim"]), f"{r['seconds']:.2f}", f"{r['examples_per_s']:.1f}"]
        + [f"{reference['seconds'] / r['seconds']:.1f}x", f"{r['peak_mb']:.0f}"]
        + [f"{r['peak_mb'] - r['baseline_mb']:.0f}"]
        for method, r in results.items()
    ]
    return markdown_table(columns, rows)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT-2, in this process")
    parser.add_argument("--batch-size", type=int, help="sequences per batch (default 16)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", help="write the markdown table here, with a machine header")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else Config()
    if args.batch_size is not None:
        if args.batch_size < 1:
            parser.error(f"--batch-size must be a positive int; got {args.batch_size}")
        config = Config(**{**asdict(config), "batch_size": args.batch_size})
    repeats = 1 if args.quick else args.repeats
    results = {}
    for method in METHODS:
        results[method] = measure(method, config, repeats, fresh=not args.quick)
        print(f"  {method}: {results[method]}", flush=True)
    text = table(results)
    publish(text, args.out, lambda: header(config, args.quick, repeats))
    return text


def header(config: Config, quick: bool, repeats: int) -> str:
    machine = machine_sentence(["torch", "transformers"], [f"load average {load_average()}"])
    return (
        f"# factored_projection.py\n\n{machine}{' (quick run)' if quick else ''}.\n\n"
        f"GPT-2 ({config.layers} layers, width {config.width}, {config.heads} heads, "
        f"{config.length} tokens, vocabulary {config.vocab}, P = {num_params(config)} "
        f"parameters untied), a batch of {config.batch_size} sequences, each method in "
        f"{'this' if quick else 'a fresh'} process, median of {repeats} after a warm-up. "
        f"factored: k_in = k_out = {K_IN}, other_dim = {config.other_dim}; materialise then "
        f"project: per-example gradients (B, P), then a dense Gaussian projection to the same D."
    )


if __name__ == "__main__":
    main()
