"""Time of each per-example-gradient strategy on Hugging Face GPT-2 and BERT, batch 32.

Run:  python benchmarks/strategies.py [--quick] [--out PATH]

Models are built from small configs (nothing downloaded): GPT-2 (causal LM loss, 4 layers,
width 128, vocab 2000, sequence 32) and BERT (sequence classification, same sizes), each with an
attention mask that pads some examples, without and with activation checkpointing
(``gradient_checkpointing_enable()``, non-reentrant). For each, side by side in one run:

* ``batch grad``: ``loss.backward()`` of the mean loss over the batch: the floor;
* ``auto``: ``pergrad.per_example_grads(loss)``, and which strategy it took;
* ``vmap`` / ``hooks`` / ``loop``: each strategy forced (``vmap`` fails on some: reported);
* ``hooks, full pass``: the hooks strategy as it ran before its later calls went light: every
  call computes the weight gradients too and checks that the per-example gradients add up to
  them (``hooks_torch._outputs`` patched to None, the path an in-place-changed output takes);
* the relative error of each against the loop (the reference), in the same run.

Median over ``--repeats`` interleaved rounds (each round runs every method once) after one
warm-up call each (which also runs the hooks' first-call checks). The FLOP column counts one
call of each method with ``torch.utils.flop_counter.FlopCounterMode`` (matrix products and
convolutions), against the batch gradient's: it does not depend on the machine's load.
Prints a markdown table; ``--out PATH`` also writes it with the machine named.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import pergrad
from pergrad._src.strategies import hooks_torch
from pergrad.bench.machine import load_average, package_version
from pergrad.bench.report import fmt, machine_info, markdown_table, publish
from pergrad.bench.timing import median_ms, time_interleaved

STRATEGIES = ("auto", "vmap", "hooks", "loop")
FULL = "hooks, full pass"


@contextlib.contextmanager
def full_pass() -> Any:
    """The hooks strategy's later calls differentiating the parameters (and checking the sum)
    instead of the layers' outputs only, as every call did before."""
    original = hooks_torch._outputs
    hooks_torch._outputs = lambda records: None
    try:
        yield
    finally:
        hooks_torch._outputs = original


def build(kind: str, checkpointing: bool, quick: bool) -> tuple[Any, Any, tuple[Any, ...]]:
    import transformers

    transformers.logging.set_verbosity_error()
    width, layers, vocab, seq, batch = (32, 1, 200, 8, 4) if quick else (128, 4, 2000, 32, 32)
    torch.manual_seed(0)
    if kind == "GPT-2":
        config = transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=seq,
            n_embd=width,
            n_layer=layers,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.BertConfig(
            vocab_size=vocab,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=4 * width,
            max_position_embeddings=seq,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=4,
        )
        model = transformers.BertForSequenceClassification(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # Hugging Face checkpoints in training mode only; dropout is 0
    else:
        model.eval()
    ids = torch.randint(1, vocab, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[::2, seq * 3 // 4 :] = 0  # every other example padded
    inputs = {"input_ids": ids * mask, "attention_mask": mask}
    if kind == "GPT-2":
        target = (ids * mask).masked_fill(mask == 0, -100)

        def loss_fn(output: Any, labels: Any) -> Any:
            logits = output.logits[:, :-1]
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    else:
        target = torch.randint(0, 4, (batch,))

        def loss_fn(output: Any, labels: Any) -> Any:
            return F.cross_entropy(output.logits, labels)

    return model, loss_fn, (inputs, target)


def relative_error(got: dict, want: dict) -> float:
    num = sum(float(((got[k] - want[k]) ** 2).sum()) for k in want)
    den = sum(float((want[k] ** 2).sum()) for k in want)
    return (num / den) ** 0.5


def run_model(kind: str, checkpointing: bool, repeats: int, quick: bool) -> list[dict]:
    model, loss_fn, (inputs, target) = build(kind, checkpointing, quick)
    loss = pergrad.module_loss(model, loss_fn)
    name = f"{kind}{' + checkpointing' if checkpointing else ''}"

    def batch_grad() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(**inputs), target).backward()

    methods: dict[str, Any] = {"batch grad": batch_grad}
    taken: dict[str, str] = {"batch grad": ""}
    results = {}
    for strategy in STRATEGIES:
        fn = pergrad.per_example_grads(loss, strategy=strategy)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results[strategy] = fn(loss.params(), inputs, target)  # warm-up, first-call checks
        except ValueError as err:
            taken[strategy] = "fails"
            print(f"  {name} / {strategy}: {str(err)[:120]}", file=sys.stderr)
            continue
        taken[strategy] = fn.last_strategy
        methods[strategy] = lambda fn=fn: fn(loss.params(), inputs, target)
        if strategy == "hooks":

            def full(fn: Any = fn) -> Any:
                with full_pass():
                    return fn(loss.params(), inputs, target)

            results[FULL], taken[FULL], methods[FULL] = full(), "hooks", full
    batch_grad()  # warm-up
    flops = {method: count_flops(call) for method, call in methods.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = time_interleaved(methods, repeats, warmup=0)  # each warmed up above
    ms = {method: median_ms(seconds) for method, seconds in times.items()}
    model.zero_grad(set_to_none=True)
    rows = []
    for method in ("batch grad", *STRATEGIES, FULL):
        row = {"model": name, "method": method, "taken": taken[method], "ms": ms.get(method)}
        row["error"] = (
            relative_error(results[method], results["loop"]) if method in results else None
        )
        row["ratio"] = None if row["ms"] is None else row["ms"] / ms["batch grad"]
        row["flops"] = flops[method] / flops["batch grad"] if method in flops else None
        row["speedup"] = None if row["ms"] is None else ms["loop"] / row["ms"]
        rows.append(row)
    return rows


def count_flops(call: Any) -> float:
    """The FLOPs of one ``call()``, as ``FlopCounterMode`` counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    with warnings.catch_warnings(), FlopCounterMode(display=False) as counter:
        warnings.simplefilter("ignore")
        call()
    return float(counter.get_total_flops())


def table(rows: list[dict]) -> str:
    columns = ["model", "method", "strategy taken", "ms", "/ batch grad", "speed-up over loop"]
    columns += ["FLOP / batch grad", "rel. error vs loop"]
    cells = [
        [r["model"], r["method"], r["taken"], fmt(r["ms"], ".1f", missing="—")]
        + [fmt(r["ratio"], ".2f", "x", missing="—"), fmt(r["speedup"], ".1f", "x", missing="—")]
        + [fmt(r["flops"], ".2f", "x", missing="—"), fmt(r["error"], ".1e", missing="—")]
        for r in rows
    ]
    return markdown_table(columns, cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, one repeat")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    rows = []
    for kind in ("GPT-2", "BERT"):
        for checkpointing in (False, True):
            rows += run_model(kind, checkpointing, repeats, args.quick)
    publish(table(rows), args.out, lambda: header(repeats))


def header(repeats: int) -> str:
    info = machine_info()
    return (
        "# Per-example gradient strategies on Hugging Face models\n\n"
        f"Produced by `python benchmarks/strategies.py` on {info['cpu']} "
        f"({info['cores']} cores, torch threads {info['torch_threads']}, GPU: "
        f"{info['gpu'] or 'none'}), Python {info['python']}, torch "
        f"{info['versions']['torch']}, transformers {package_version('transformers')}, "
        f"{info['date']}. Batch 32, sequence 32, 4 layers, width 128, vocab 2000; "
        f"median of {repeats} interleaved rounds after a warm-up; load average "
        f"{load_average()} at the end."
    )


if __name__ == "__main__":
    main()
