"""DP fine-tuning of a small GPT-2 on the Python standard library's docstrings, offline.

Run:  python examples/dp_finetune_gpt2.py [--steps 300] [--epsilon 8] [--quick]

The corpus is the docstrings of some fifty standard-library modules (every machine that runs
Python has them, nothing is downloaded), read as bytes and cut into 64-byte examples; every
tenth example is held out for validation. A small GPT-2 (Hugging Face ``transformers``, 2
layers, width 64, its input embedding tied to the LM head, byte vocabulary) is trained twice
for the same number of steps with AdamW:

- without privacy, on shuffled batches of the expected batch size;
- with DP-SGD through ``pergrad.dp.DPOptimizer``: Poisson-sampled batches, each example's
  gradient clipped to ``--max-norm``, Gaussian noise with the multiplier that
  ``pergrad.dp.noise_multiplier_for`` calibrates for ``--epsilon`` at delta = 1 / n^1.1 over
  the whole run, an ``Accountant`` counting the steps.

It prints epsilon and validation perplexity side by side (a byte-level model that learned
nothing has perplexity 256) and which strategy pergrad's ``"auto"`` took: for a model this small
its cost model finds materialised per-example gradients cheaper than the ghost norms
(``materialize``); a larger model takes the ghost path, where no per-example gradient is formed.
Either way the tied embedding / LM head never sends it to a slower fallback.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from tqdm import tqdm

from pergrad import dp

STDLIB = """
abc argparse array ast asyncio base64 bisect calendar collections contextlib copy csv
dataclasses datetime decimal difflib enum fractions functools glob gzip hashlib heapq hmac
inspect io ipaddress itertools json logging math operator os pathlib pickle pprint queue
random re shutil statistics string struct subprocess tarfile tempfile textwrap threading
typing unittest uuid warnings zipfile
"""
MODULES = STDLIB.split()
SEQ, DELTA_EXPONENT = 64, 1.1


def docstrings() -> str:
    """The docstrings of MODULES and of their public classes and functions, in a fixed order."""
    pieces = []
    for name in MODULES:
        module = importlib.import_module(name)
        pieces.append(inspect.getdoc(module) or "")
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr, None)
            if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
                doc = inspect.getdoc(obj)
                if doc and getattr(obj, "__module__", None) == name:
                    pieces.append(doc)
    return "\n\n".join(pieces)


def examples(limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """64-byte examples of the corpus: (train, validation), every tenth held out."""
    data = np.frombuffer(docstrings().encode("utf-8"), dtype=np.uint8)
    rows = torch.from_numpy(data[: len(data) // SEQ * SEQ].reshape(-1, SEQ).astype(np.int64))
    if limit is not None:
        rows = rows[:limit]
    held_out = torch.arange(len(rows)) % 10 == 0
    return rows[~held_out], rows[held_out]


def gpt2(seed: int) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        vocab_size=256,
        n_positions=SEQ,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def lm_loss(output, ids: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy, the mean over tokens (so one example's loss is its own mean)."""
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    model.eval()
    losses = [lm_loss(model(chunk), chunk) * len(chunk) for chunk in ids.split(256)]
    return math.exp(float(sum(losses)) / len(ids))


def train_non_private(train: torch.Tensor, args, progress: bool) -> torch.nn.Module:
    model = gpt2(args.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    batch = max(1, round(args.sample_rate * len(train)))
    for _ in tqdm(range(args.steps), desc="non-private", disable=not progress, leave=False):
        ids = train[torch.randint(len(train), (batch,), generator=generator)]
        optimizer.zero_grad()
        lm_loss(model(ids), ids).backward()
        optimizer.step()
    return model


def train_private(train: torch.Tensor, args, progress: bool):
    delta = 1.0 / len(train) ** DELTA_EXPONENT
    sigma = dp.noise_multiplier_for(args.epsilon, delta, args.sample_rate, args.steps)
    accountant = dp.Accountant(sigma, args.sample_rate, delta)
    model = gpt2(args.seed)
    model.train()
    optimizer = dp.DPOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        model,
        lm_loss,
        max_norm=args.max_norm,
        noise_multiplier=sigma,
        expected_batch_size=args.sample_rate * len(train),
        # A fixed seed keeps the example reproducible; for a real guarantee draw it securely
        # (secrets.randbits) or pass dp.SecureRandom().
        generator=torch.Generator().manual_seed(args.seed),
        accountant=accountant,
    )
    batches = dp.poisson_batches(len(train), args.sample_rate, args.steps, seed=args.seed)
    strategies = set()
    bar = tqdm(batches, total=args.steps, desc="DP-SGD", disable=not progress, leave=False)
    for step, indices in enumerate(bar):
        ids = train[torch.from_numpy(indices)]
        stats = optimizer.step(ids, ids)  # the inputs are also the targets (shifted in lm_loss)
        strategies.add(stats.strategy)
        if progress and (step + 1) % 50 == 0:
            bar.set_postfix(epsilon=f"{accountant.epsilon():.2f}", clipped=stats.clip_fraction)
    return model, accountant, sigma, delta, sorted(strategies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--sample-rate", type=float, default=0.01)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a few steps on a few examples")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's RDP notes
    limit = None
    if args.quick:
        args.steps, args.sample_rate, limit = 8, 0.05, 600
    train, val = examples(limit)
    progress = not args.no_progress
    print(
        f"corpus: {len(train)} training and {len(val)} validation examples of {SEQ} bytes "
        f"({len(MODULES)} standard-library modules' docstrings); {args.steps} steps, expected "
        f"batch {args.sample_rate * len(train):.0f}"
    )
    start = time.perf_counter()
    plain = train_non_private(train, args, progress)
    plain_time = time.perf_counter() - start
    start = time.perf_counter()
    private, accountant, sigma, delta, strategies = train_private(train, args, progress)
    private_time = time.perf_counter() - start
    untrained = perplexity(gpt2(args.seed), val)
    print(f"noise multiplier {sigma:.3f} for epsilon {args.epsilon:g} at delta {delta:.1e}")
    print("| training | epsilon | validation perplexity | wall time |")
    print("| --- | --- | --- | --- |")
    print(f"| untrained | - | {untrained:.1f} | - |")
    print(f"| non-private | inf | {perplexity(plain, val):.2f} | {plain_time:.1f} s |")
    print(
        f"| DP-SGD (pergrad) | {accountant.epsilon():.2f} | {perplexity(private, val):.2f} "
        f"| {private_time:.1f} s |"
    )
    print(f"pergrad strategy: {', '.join(strategies)}")


if __name__ == "__main__":
    main()
