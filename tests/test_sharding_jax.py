"""JAX with the batch sharded over 4 (forced host) devices gives the one-device results.

XLA_FLAGS must be set before jax is imported, and forced devices must not leak into the other
tests, so every check runs in ONE subprocess (``_CHECKS``) that prints its results as JSON;
the tests below read that JSON. References are computed in the same subprocess on one device,
from unsharded arrays.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax", reason="sharding is a JAX feature")
pytest.importorskip("optax", reason="the DP step uses optax")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sharded_dp_jax.py"
DEVICES = 4

_CHECKS = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import pergrad

assert jax.device_count() == 4, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("batch",))
replicated = NamedSharding(mesh, P())
B, D, H, C = 32, 16, 24, 5
rng = np.random.default_rng(0)  # numpy's: jax.random would compile once per array shape
params = {"w1": jnp.asarray(rng.normal(size=(D, H)) / 4, jnp.float32), "b1": jnp.zeros(H),
          "w2": jnp.asarray(rng.normal(size=(H, C)) / 4, jnp.float32)}
P_SIZE = sum(x.size for x in jax.tree.leaves(params))
X = jnp.asarray(rng.normal(size=(B, D)), jnp.float32)
Y = jnp.asarray(rng.integers(0, C, B), jnp.int32)

def loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return -jax.nn.log_softmax(h @ p["w2"])[y]

grads_of = pergrad.per_example_grads(loss)
sharded_params = jax.device_put(params, replicated)
Xs, Ys = pergrad.dp.shard_batch((X, Y), mesh)
out = {"P": P_SIZE, "B": B}

def diff(a, b):  # in numpy: jnp would compile each operation for each leaf's shape
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in pairs)

def collectives(hlo):
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute|"
                      r"reduce-scatter)(?:-start)?\(", line)
        if m:
            sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
                     for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", m.group(1))]
            found.append([m.group(2), sizes])
    return found

def compiled_collectives(f, *args):
    return collectives(jax.jit(f).lower(*args).compile().as_text())

# -- jit over sharded inputs -----------------------------------------------------------------
single = grads_of(params, X, Y)
sharded = jax.jit(grads_of)(sharded_params, Xs, Ys)
out["grads_diff"] = diff(sharded, single)
out["grads_spec"] = [list(leaf.sharding.spec) for leaf in jax.tree.leaves(sharded)]
out["grads_collectives"] = compiled_collectives(grads_of, sharded_params, Xs, Ys)
norms = lambda p, x, y: pergrad.norms.per_example_norms(grads_of(p, x, y))
BOUND = float(jnp.median(norms(params, X, Y)))  # about half the examples get clipped
out["norms_diff"] = diff(jax.jit(norms)(sharded_params, Xs, Ys), norms(params, X, Y))
norms_of = lambda p, x, y: pergrad.norms.per_example_norms_of(loss, p, x, y)
out["norms_of_diff"] = diff(jax.jit(norms_of)(sharded_params, Xs, Ys), norms(params, X, Y))
clipped = lambda p, x, y: pergrad.dp.clipped_sum(grads_of(p, x, y), BOUND)
reference = clipped(params, X, Y)
got = jax.jit(clipped)(sharded_params, Xs, Ys)
out["clipped_sum_diff"] = diff(got.sum, reference.sum)
out["clip_fraction"] = [float(got.clip_fraction), float(reference.clip_fraction)]
clipped_of = lambda p, x, y: pergrad.dp.clipped_sum_of(loss, p, x, y, max_norm=BOUND)
out["clipped_sum_of_diff"] = diff(jax.jit(clipped_of)(sharded_params, Xs, Ys).sum, reference.sum)

def make_step(noise, axis_name=None):
    tx = pergrad.dp.dpsgd(0.5, BOUND, noise, 7, expected_batch_size=B, axis_name=axis_name)
    def step(p, state, x, y):
        # inside shard_map, pergrad makes p per-device itself (no pcast needed)
        updates, state = tx.update(grads_of(p, x, y), state, p)
        return optax.apply_updates(p, updates), state
    return tx, step

one_device = {}  # noise -> the one-device step's (params, state), the shard_map one's reference
for noise in (0.0, 1.0):
    tx, step = make_step(noise)
    state = tx.init(params)
    one_params, one_state = one_device[noise] = jax.jit(step)(params, state, X, Y)
    many_params, many_state = jax.jit(step)(sharded_params, jax.device_put(state, replicated),
                                            Xs, Ys)
    out[f"step_diff_noise{noise:g}"] = diff(many_params, one_params)
    out[f"step_moved_noise{noise:g}"] = diff(one_params, params)
    if noise == 0.0:
        out["step_clip_fraction"] = [float(many_state[0].clip_fraction),
                                     float(one_state[0].clip_fraction)]
        out["step_collectives"] = compiled_collectives(
            step, sharded_params, jax.device_put(state, replicated), Xs, Ys)
# Chunks are strided, so each device keeps its own examples: no gather either.
chunked_grads_of = pergrad.per_example_grads(loss, chunk_size=8)  # one function: one compile
out["chunked_grads_diff"] = diff(jax.jit(chunked_grads_of)(sharded_params, Xs, Ys), single)
out["chunked_collectives"] = compiled_collectives(chunked_grads_of, sharded_params, Xs, Ys)
out["chunked_norms_of_collectives"] = compiled_collectives(
    lambda p, x, y: pergrad.norms.per_example_norms_of(loss, p, x, y, chunk_size=8),
    sharded_params, Xs, Ys)
# A program known to gather the inputs (the batch replicated): the HLO parser sees it.
out["control_collectives"] = compiled_collectives(
    lambda x: jax.lax.with_sharding_constraint(x * 2, replicated), Xs)

# -- shard_map: each device runs the step on its own examples -------------------------------
from jax import shard_map
data = (P("batch"), P("batch"))
for noise in (0.0, 1.0):
    tx, step = make_step(noise, axis_name="batch")
    state = tx.init(params)
    mapped = jax.jit(shard_map(step, mesh=mesh, in_specs=(P(), P(), *data),
                               out_specs=(P(), P())))
    many_params, many_state = mapped(sharded_params, state, Xs, Ys)
    one_params, one_state = one_device[noise]  # the same step, state and batch as above
    out[f"shard_map_step_diff_noise{noise:g}"] = diff(many_params, one_params)
    out[f"shard_map_clip_fraction_noise{noise:g}"] = [float(many_state[0].clip_fraction),
                                                     float(one_state[0].clip_fraction)]
    if noise == 0.0:
        out["shard_map_step_collectives"] = collectives(
            mapped.lower(sharded_params, state, Xs, Ys).compile().as_text())

def local_pieces(p, x, y):
    total = pergrad.dp.psum_clipped(
        pergrad.dp.clipped_sum_of(loss, p, x, y, max_norm=BOUND), "batch")
    return grads_of(p, x, y), pergrad.norms.per_example_norms_of(loss, p, x, y), total.sum
grads_sm, norms_sm, sum_sm = jax.jit(shard_map(
    local_pieces, mesh=mesh, in_specs=(P(), *data), out_specs=(P("batch"), P("batch"), P())
))(sharded_params, Xs, Ys)
out["shard_map_grads_diff"] = diff(grads_sm, single)
out["shard_map_norms_diff"] = diff(norms_sm, norms(params, X, Y))
out["shard_map_clipped_sum_of_diff"] = diff(sum_sm, reference.sum)

def errors_of(call):
    try:
        call()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None

tx, _ = make_step(0.0, axis_name="batch")
def forgot_pcast(p, state, x, y):
    # hand-written vmap(grad) of replicated params: JAX sums each example over the devices
    return tx.update(jax.vmap(jax.grad(loss), (None, 0, 0))(p, x, y), state, p)
out["error_no_pcast"] = errors_of(lambda: jax.jit(shard_map(
    forgot_pcast, mesh=mesh, in_specs=(P(), P(), *data), out_specs=(P(), P())
))(sharded_params, tx.init(params), Xs, Ys))
out["error_unbound_axis"] = errors_of(
    lambda: pergrad.dp.clipped_sum(single, 0.5, axis_name="batch"))
out["error_indivisible"] = errors_of(lambda: pergrad.dp.shard_batch((X[:30], Y[:30]), mesh))
out["error_bad_axis"] = errors_of(lambda: pergrad.dp.shard_batch((X, Y), mesh, "data"))
explicit = jax.make_mesh((4,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))
out["error_explicit_axis"] = errors_of(lambda: pergrad.dp.shard_batch((X, Y), explicit))
print("RESULTS " + json.dumps(out))
"""


def _run(script: str, tmp_path: Path) -> dict:
    path = tmp_path / "sharded_checks.py"
    path.write_text(script)
    # The programs are tiny, so XLA's compile time is what the checks wait for: the backend's
    # lowest optimisation level halves it (results change only by rounding; the collectives
    # are the partitioner's, before the backend), as in tests/test_layouts_jax.py.
    flags = f"--xla_force_host_platform_device_count={DEVICES} --xla_backend_optimization_level=0"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = [row for row in result.stdout.splitlines() if row.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS ") :])


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run(_CHECKS, tmp_path_factory.mktemp("sharding"))


def gathers(found: list, min_size: int) -> list:
    return [c for c in found if c[0] in ("all-gather", "all-to-all") and max(c[1]) >= min_size]


def test_sharded_per_example_grads_equal_one_device_and_stay_sharded(results):
    assert results["grads_diff"] < 1e-6
    assert all(spec[:1] == ["batch"] for spec in results["grads_spec"])
    assert results["grads_collectives"] == []


def test_sharded_norms_and_clipped_sums_equal_one_device(results):
    assert results["norms_diff"] < 1e-5
    assert results["norms_of_diff"] < 1e-5
    assert results["clipped_sum_diff"] < 1e-5
    assert results["clipped_sum_of_diff"] < 1e-5
    fraction, reference = results["clip_fraction"]
    assert fraction == reference and 0 < reference < 1  # some examples clipped, not all


def test_sharded_dp_step_equals_one_device_with_and_without_noise(results):
    assert results["step_diff_noise0"] < 1e-6
    # The same key gives the same noise, added once: a second draw per device would differ
    # by about the noise scale (lr * std / B, std = the bound).
    assert results["step_moved_noise1"] > 1e-3
    assert results["step_diff_noise1"] < 1e-6
    fraction, reference = results["step_clip_fraction"]
    assert fraction == reference


def test_compiled_dp_step_sends_only_the_summed_gradient(results):
    found = results["step_collectives"]
    batch, num_params = results["B"], results["P"]
    assert gathers(found, batch) == [], found  # no per-example arrays gathered
    reduced = [size for op, sizes in found if op == "all-reduce" for size in sizes]
    assert num_params <= sum(reduced) <= num_params + 8, found  # the P-sized sum, a few scalars
    # The parser does see a gather where there is one.
    assert gathers(results["control_collectives"], batch)


def test_chunked_per_example_grads_and_norms_stay_on_their_devices(results):
    assert results["chunked_grads_diff"] < 1e-6
    assert results["chunked_collectives"] == []
    assert gathers(results["chunked_norms_of_collectives"], results["B"]) == []


def test_shard_map_step_equals_one_device_and_adds_noise_once(results):
    assert results["shard_map_step_diff_noise0"] < 1e-6
    assert results["shard_map_step_diff_noise1"] < 1e-6
    for noise in ("0", "1"):
        fraction, reference = results[f"shard_map_clip_fraction_noise{noise}"]
        assert abs(fraction - reference) < 1e-7
    found = results["shard_map_step_collectives"]
    assert gathers(found, results["B"]) == [], found
    reduced = [size for op, sizes in found if op == "all-reduce" for size in sizes]
    assert results["P"] <= sum(reduced) <= results["P"] + 8, found


def test_shard_map_grads_norms_and_clipped_sum_of_equal_one_device(results):
    assert results["shard_map_grads_diff"] < 1e-6
    assert results["shard_map_norms_diff"] < 1e-5
    assert results["shard_map_clipped_sum_of_diff"] < 1e-5


def test_bad_input_errors_name_the_problem(results):
    assert results["error_no_pcast"].startswith("PergradValueError")
    assert "jax.lax.pcast(params, 'batch', to='varying')" in results["error_no_pcast"]
    assert results["error_unbound_axis"].startswith("PergradValueError")
    assert "not a mapped axis" in results["error_unbound_axis"]
    message = results["error_indivisible"]
    assert message.startswith("PergradValueError") and "30 examples" in message
    assert "4 devices" in message and "32" in message
    assert "is not an axis of the mesh" in results["error_bad_axis"]
    assert "AxisType.Explicit" in results["error_explicit_axis"]


def test_sharded_dp_example_runs_and_matches_one_device():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the example sets them
    # Its steps are small and few: compiling is most of the run, and JAX without XLA's backend
    # optimisations halves it (results change only by rounding).
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "devices: 4" in result.stdout
    rows = [line for line in result.stdout.splitlines() if "max |sharded - one device|" in line]
    assert len(rows) == 2  # jit over sharded inputs, and shard_map
    for row in rows:
        assert float(row.rsplit(" ", 1)[1]) < 1e-5
