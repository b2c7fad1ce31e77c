"""The runnable examples run and say what they promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
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


def run_example_args(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=fast_compile_env(),
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_quickstart_checks_the_mean_on_both_backends():
    pytest.importorskip("jax", reason="the quickstart runs JAX")
    pytest.importorskip("torch", reason="the quickstart runs PyTorch")
    out = run_example("quickstart.py", fast_compile_env())
    lines = [line for line in out.splitlines() if "mean == batch gradient" in line]
    assert [line.split(":")[0].strip() for line in lines] == ["JAX", "PyTorch"]


@pytest.mark.slow(reason="a training run on digits in a subprocess: about 10 s on 2 CPU cores")
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


@pytest.mark.slow(
    reason="two DP-SGD training runs on digits in a subprocess: about 13 s on 2 CPU cores"
)
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


@pytest.mark.slow(reason="trains and scores digits in a subprocess: about 8 s on 2 CPU cores")
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


@pytest.mark.slow(reason="a GPT-2 fine-tune quick run in a subprocess: about 8 s on 2 CPU cores")
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
    # the tied embedding / LM head never forces a slow fallback: auto takes the ghost norms or,
    # for a model this small, the materialised per-example gradients its cost model prefers
    assert re.search(r"pergrad strategy: (ghost|materialize)$", result.stdout, re.M)


@pytest.mark.slow(
    reason="two epochs of transformers.Trainer on digits in a subprocess: about 15 s on 2 CPU cores"
)
def test_monitor_flipped_labels_quick_run_logs_the_curves_and_saves_the_plot(tmp_path):
    pytest.importorskip("sklearn", reason="the example uses scikit-learn's bundled digits")
    pytest.importorskip("transformers", reason="the example trains with transformers.Trainer")
    pytest.importorskip("matplotlib", reason="the example saves the training curves")
    image = tmp_path / "curves.png"
    out = run_example_args("monitor_flipped_labels.py", "--quick", "--out", str(image))
    rows = [
        [float(cell) for cell in line.split("|")[1:-1]]
        for line in out.splitlines()
        if line.startswith("| ") and "---" not in line and "epoch" not in line
    ]
    assert [row[0] for row in rows] == [1, 2]
    for _, _, q10, q50, q90, clipped, noise_scale in rows:
        assert 0 < q10 <= q50 <= q90 and 0 <= clipped <= 1
        assert 0 < noise_scale < float("inf")  # the running estimate is a number, never inf
    assert rows[1][3] < rows[0][3]  # the median norm falls as the model fits
    assert image.stat().st_size > 10_000


def load_example(name: str):
    """An example script as a module, for its functions (its ``main`` is not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clipped_mean_step(per_example_grads, params, max_norm, expected_batch_size, lr):
    """A DP-SGD step written by hand with noise off, in float64: clip each example's gradient
    (a dict of numpy arrays) to max_norm, sum, divide by the expected batch size, SGD."""
    total = {name: np.zeros_like(value, dtype=np.float64) for name, value in params.items()}
    for grads in per_example_grads:
        norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in grads.values()))
        factor = min(1.0, max_norm / norm)
        for name, g in grads.items():
            total[name] += factor * np.asarray(g, np.float64)
    return {name: params[name] - lr * total[name] / expected_batch_size for name in params}


def test_dp_jax_port_step_equals_a_hand_written_clipped_mean_step_in_float64():
    pytest.importorskip("sklearn", reason="the example uses scikit-learn's bundled digits")
    jax = pytest.importorskip("jax", reason="the example runs JAX")
    optax = pytest.importorskip("optax", reason="the example runs optax")

    port = load_example("dp_jax_port.py")
    x_train, _, y_train, _ = port.load_digits_split()
    with jax.enable_x64(True):
        x64 = x_train.astype(np.float64)
        tx, loader, _ = port.dp.make_private_optax(
            x64, y_train, batch_size=port.BATCH_SIZE, steps=1, noise_multiplier=0.0,
            delta=port.DELTA, max_norm=port.L2_NORM_CLIP,
            optimizer=optax.sgd(port.LEARNING_RATE), key=0, seed=0,
        )  # fmt: skip
        params = jax.tree_util.tree_map(jax.numpy.asarray, port.init_params(dtype=np.float64))
        images, labels, mask = next(iter(loader))
        new_params, _ = port.make_step(tx)(params, tx.init(params), images, labels, mask)
        real = np.asarray(mask)
        grad_of_one = jax.jit(jax.grad(port.loss))
        one_by_one = [  # the original's loss of one example, differentiated example by example
            grad_of_one(params, image, label)
            for image, label in zip(np.asarray(images)[real], np.asarray(labels)[real])
        ]
        expected = clipped_mean_step(
            one_by_one, {k: np.asarray(v) for k, v in params.items()}, port.L2_NORM_CLIP,
            port.BATCH_SIZE, port.LEARNING_RATE,
        )  # fmt: skip
    assert real.sum() > 30  # a real Poisson batch (expected size 64)
    for name, value in expected.items():
        np.testing.assert_allclose(np.asarray(new_params[name]), value, rtol=1e-10, atol=1e-12)


@pytest.mark.slow(
    reason="one epoch of the JAX port in a subprocess (its step is checked by a default test): about 6 s"
)
def test_dp_jax_port_quick_run_learns_and_reports_its_epsilon():
    pytest.importorskip("sklearn", reason="the example uses scikit-learn's bundled digits")
    pytest.importorskip("dp_accounting", reason="the example accounts its run")
    out = run_example_args("dp_jax_port.py", "--quick", "--seed", "0")
    assert "epoch 1: test accuracy" in out and "(pld)" in out and "(rdp)" in out
    pld, rdp = (float(part.split()[-2]) for part in out.splitlines()[-1].split(",")[:2])
    assert 0 < pld < rdp  # PLD is the tighter of the two accountants


def test_dp_opacus_port_step_equals_a_hand_written_clipped_mean_step_in_float64():
    pytest.importorskip("sklearn", reason="the example uses scikit-learn's bundled digits")
    torch = pytest.importorskip("torch", reason="the example runs PyTorch")

    port = load_example("dp_opacus_port.py")
    train_set, _ = port.load_digits_split()
    images, labels = train_set.tensors
    data = torch.utils.data.TensorDataset(images.double(), labels)
    torch.manual_seed(0)
    model = port.SampleConvNet().double()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer, loader, _ = port.dp.make_private(
        model, torch.optim.SGD(model.parameters(), lr=port.LR), data,
        torch.nn.functional.cross_entropy, batch_size=port.BATCH_SIZE, steps=1,
        noise_multiplier=0.0, max_norm=port.MAX_PER_SAMPLE_GRAD_NORM, delta=port.DELTA,
        sampler_generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    x, y = next(iter(loader))
    stats = optimizer.step(x, y)
    reference = port.SampleConvNet().double()
    reference.load_state_dict(params)
    one_by_one = []
    for i in range(len(y)):  # Opacus's loss, one example at a time, by autograd
        loss = torch.nn.functional.cross_entropy(reference(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(reference.parameters()))
        names = [name for name, _ in reference.named_parameters()]
        one_by_one.append({n: g.numpy() for n, g in zip(names, grads)})
    expected = clipped_mean_step(
        one_by_one, {k: v.numpy() for k, v in params.items()},
        port.MAX_PER_SAMPLE_GRAD_NORM, port.BATCH_SIZE, port.LR,
    )  # fmt: skip
    assert len(y) > 30 and stats.loss is not None
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), expected[name], rtol=1e-10, atol=1e-12)


@pytest.mark.slow(
    reason="one epoch of the Opacus port in a subprocess (its step is checked by a default test): about 6 s"
)
def test_dp_opacus_port_quick_run_prints_loss_and_epsilon():
    pytest.importorskip("sklearn", reason="the example uses scikit-learn's bundled digits")
    pytest.importorskip("torch", reason="the example runs PyTorch")
    out = run_example_args("dp_opacus_port.py", "--quick", "--seed", "0")
    (line,) = [line for line in out.splitlines() if line.startswith("Train Epoch: 1")]
    loss = float(line.split("Loss:")[1].split()[0])
    assert 1.0 < loss < 3.0 and "δ = 1e-05" in line  # about log(10) after one noisy epoch
    assert "Test set: accuracy" in out
