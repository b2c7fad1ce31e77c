"""Data-parallel DP-SGD in PyTorch over torch.distributed: scikit-learn's digits, epsilon 3.

Run:  python examples/dp_sgd_distributed_torch.py [--processes 2] [--epochs 20] [--quick]
      torchrun --nproc_per_node 2 examples/dp_sgd_distributed_torch.py

Without torchrun the script starts ``--processes`` copies of its training function itself. Every
process joins a gloo process group (nccl on GPUs), builds the same 64-32-10 MLP and a
``DPOptimizer(..., distributed=True)``, and draws its own shard of each Poisson batch with
``PoissonBatchSampler(..., num_replicas=world_size, rank=rank)``. Each process clips its own
examples; the optimizer sums the clipped sums over processes and adds the noise once, so the
run is DP-SGD at the global sample rate, accounted as such. Rank 0 prints the test accuracy, the
epsilon spent, and whether every process ended with the same parameters.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from pergrad import dp

HIDDEN, DELTA, TARGET_EPSILON, SAMPLE_RATE, MAX_NORM, LR = 32, 1e-5, 3.0, 0.05, 1.0, 0.5


def load_digits_split() -> list[np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return train_test_split(x, digits.target, test_size=0.25, random_state=0)


def train(rank: int, world_size: int, init_method: str, epochs: int) -> None:
    """One process of the run (torchrun's, or one started by ``main``)."""
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's skipped RDP orders
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    x_train, x_test, y_train, y_test = load_digits_split()
    n, steps = len(x_train), int(epochs / SAMPLE_RATE)
    noise_multiplier = dp.noise_multiplier_for(
        target_epsilon=TARGET_EPSILON, delta=DELTA, sample_rate=SAMPLE_RATE, steps=steps
    )
    model = nn.Sequential(nn.Linear(64, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 10))
    dp.broadcast_parameters(model)  # every process starts from rank 0's initial weights
    optimizer = dp.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        F.cross_entropy,
        max_norm=MAX_NORM,
        noise_multiplier=noise_multiplier,
        expected_batch_size=SAMPLE_RATE * n,  # the GLOBAL expected batch size
        generator=torch.Generator().manual_seed(secrets.randbits(63)),  # rank 0's is used
        accountant=dp.Accountant(noise_multiplier, sample_rate=SAMPLE_RATE, delta=DELTA),
        distributed=True,
    )
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    sampler = dp.PoissonBatchSampler(n, SAMPLE_RATE, steps, num_replicas=world_size, rank=rank)
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=dp.collate_with_empty_batches(dataset)
    )
    for x, y in loader:  # this process's shard; it may be empty, and still takes part
        optimizer.step(x, y)
    with torch.no_grad():
        accuracy = (model(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        same = all(torch.equal(flat, other) for other in gathered)
        print(
            f"{world_size} processes, {steps} steps of expected global batch "
            f"{SAMPLE_RATE * n:.0f}, noise multiplier {noise_multiplier:.3f}: test accuracy "
            f"{accuracy:.3f}, epsilon {optimizer.accountant.epsilon():.2f} at delta {DELTA}; "
            f"parameters identical on every process: {same}"
        )
    dist.barrier()  # leave together: tearing gloo down under a peer aborts it
    dist.destroy_process_group()
    # gloo can still abort in C++ destructors at interpreter exit (exit -6, about one run in
    # five with torch 2.13): the process has nothing left to do, so skip them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="without torchrun")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="2 epochs, for a smoke run")
    args = parser.parse_args()
    epochs = 2 if args.quick else args.epochs
    if "RANK" in os.environ:  # started by torchrun, which sets the rendezvous variables
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", epochs)
        return
    with tempfile.TemporaryDirectory() as directory:
        init_method = f"file://{os.path.join(directory, 'store')}"
        mp.spawn(train, args=(args.processes, init_method, epochs), nprocs=args.processes)


if __name__ == "__main__":
    main()
