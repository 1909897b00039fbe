"""The learner as several processes: 2 processes x 4 virtual CPU
devices, cross-process collectives over gloo, give the same parameters after 3 train
steps as 1 process x 8 devices and as 1 device (this pytest process).

Data path under test (spopp_jax/sharding.py module doc): only process 0 builds the batch
(the orchestrator's role); the other process passes a zero placeholder of the same
shapes, ``broadcast_from_process_0`` hands it process 0's batch, and
``shard_global_batch`` keeps each process's rows. A wrong data path (each process using
its own batch) would train process 1's devices on zeros and change the parameters.

Worker: ``python tests/test_multiprocess_learner.py OUT NUM_PROCESSES PROCESS_ID PORT
DEVICES_PER_PROCESS`` (the device count must be set before jax is imported).
"""

import os
import socket
import subprocess
import sys

import numpy as np

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={sys.argv[5]}"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import pytest

from spopp_jax import learner, sharding
from test_sharding import build_case, flat_numpy
from worker_processes import wait_all

NUM_STEPS = 3
MESH = dict(data=2, fsdp=2, tensor=2)
WORKER_TIMEOUT_S = 600


def worker(out_dir: str, num_processes: int, process_id: int, port: int) -> None:
    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        sharding.initialize_distributed(f"127.0.0.1:{port}", num_processes, process_id)
    assert jax.device_count() == 8 and jax.process_count() == num_processes, jax.devices()
    model_def, state, batch, config = build_case()
    if jax.process_index() != 0:  # only process 0 holds the data (the orchestrator)
        batch = jax.tree.map(np.zeros_like, batch)
    batch = sharding.broadcast_from_process_0(jax.device_get(batch))
    mesh = sharding.make_mesh(**MESH)
    state_sharding = sharding.train_state_sharding(state, mesh, learner.make_optimizer(config))
    state = sharding.shard_train_state(state, state_sharding)
    batch = sharding.shard_global_batch(batch, mesh)
    local_rows = {shard.data.shape[0] for shard in batch.input_ids.addressable_shards}
    step = learner.make_train_step(model_def, config, state_sharding, sharding.batch_sharding(mesh, batch))
    losses = []
    for _ in range(NUM_STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    from jax.experimental import multihost_utils

    params = multihost_utils.process_allgather(state.params, tiled=True)
    if jax.process_index() == 0:
        out = {f"params/{k}": v for k, v in flat_numpy(params).items()}
        out["losses"] = np.asarray(losses)
        out["local_devices"] = np.asarray(len(jax.local_devices()))
        out["local_batch_rows"] = np.asarray(sorted(local_rows))
        np.savez(os.path.join(out_dir, "result.npz"), **out)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(out_dir, num_processes: int, devices_per_process: int) -> list[subprocess.Popen]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_root, env.get("PYTHONPATH")]))
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(out_dir), str(num_processes), str(i),
             str(port), str(devices_per_process)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(num_processes)
    ]


def collect(out_dir, procs: list[subprocess.Popen]) -> dict:
    wait_all(procs, WORKER_TIMEOUT_S)
    with np.load(os.path.join(out_dir, "result.npz")) as data:
        return dict(data)


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    """(2 processes x 4 devices, 1 process x 8 devices), the three workers run at once."""
    two_dir, one_dir = tmp_path_factory.mktemp("two_processes"), tmp_path_factory.mktemp("one_process")
    two = spawn(two_dir, num_processes=2, devices_per_process=4)
    one = spawn(one_dir, num_processes=1, devices_per_process=8)
    try:
        return collect(two_dir, two), collect(one_dir, one)
    finally:
        for proc in two + one:
            if proc.poll() is None:
                proc.kill()


@pytest.fixture(scope="module")
def two_process_result(sharded_results):
    return sharded_results[0]


@pytest.fixture(scope="module")
def eight_device_result(sharded_results):
    return sharded_results[1]


@pytest.fixture(scope="module")
def one_device_result():
    assert jax.device_count() == 1
    model_def, state, batch, config = build_case()
    step = learner.make_train_step(model_def, config)
    losses = []
    for _ in range(NUM_STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    out = {f"params/{k}": v for k, v in flat_numpy(state.params).items()}
    out["losses"] = np.asarray(losses)
    return out


def assert_same_training(result, reference):
    params = [k for k in reference if k.startswith("params/")]
    assert params and set(params) == {k for k in result if k.startswith("params/")}
    np.testing.assert_allclose(result["losses"], reference["losses"], rtol=1e-5)
    for key in params:
        # atol = 1% of one AdamW step (lr 1e-3), as in tests/test_sharding.py
        np.testing.assert_allclose(result[key], reference[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_two_processes_really_split_devices_and_batch(two_process_result):
    assert int(two_process_result["local_devices"]) == 4
    assert two_process_result["local_batch_rows"].tolist() == [2]  # 8 rows over data*fsdp = 4


def test_two_processes_match_one_process_of_eight_devices(two_process_result, eight_device_result):
    assert_same_training(two_process_result, eight_device_result)


def test_two_processes_match_one_device(two_process_result, one_device_result):
    assert_same_training(two_process_result, one_device_result)
    initial = flat_numpy(build_case()[1].params)
    moved = max(np.abs(two_process_result[f"params/{k}"] - v).max() for k, v in initial.items())
    assert moved > 1e-4  # 3 steps really trained (lr 1e-3)


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
