"""train.py's command line: user mistakes end in one line and exit status 2 (no
traceback); verl aliases reach the config; the tiny job's terminal output has no
traceback or third-party notice and the run leaves the final policy as a HF folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_run import tiny_train_args

ROOT = Path(__file__).resolve().parents[1]
TORCH_NOTICE = "PyTorch was not found"


def _train(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def _assert_one_line_exit_2(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_missing_config_file(tmp_path):
    _assert_one_line_exit_2(_train("--config_path", str(tmp_path / "recipe.yaml")),
                            "error: --config_path", "no such file")


def test_config_from_another_version(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("steps: 3\nloss:\n  clip_ratio_lo: 0.2\n")
    _assert_one_line_exit_2(_train("--config_path", str(old)), "config error:", str(old),
                            "loss.clip_ratio_lo", "another version", "loss.clip_low")


def test_unwritable_output_dir(tmp_path):
    (tmp_path / "a_file").write_text("x")
    _assert_one_line_exit_2(_train("--output_dir", str(tmp_path / "a_file" / "run")),
                            "error: output_dir=", "cannot be written")


def test_missing_model_folder(tmp_path):
    _assert_one_line_exit_2(_train("--model.path", str(tmp_path / "qwen")),
                            "error: model.path=", "does not exist")


def test_refused_verl_alias(tmp_path):
    _assert_one_line_exit_2(_train("--actor.ppo_epochs", "2"), "config error:",
                            "actor.ppo_epochs", "--optim.num_mini_batches")


def test_verl_aliases_reach_the_config():
    sys.path.insert(0, str(ROOT))
    from train import parse_config

    cfg = parse_config(["--actor.clip_ratio_low", "0.1", "actor_rollout_ref.actor.clip_ratio_c=3",
                        "--export_every", "20"])
    assert (cfg.loss.clip_low, cfg.method.dual_clip, cfg.export_every) == (0.1, 3.0, 20)


# train.py run as a newcomer would, but with torch made unimportable (a JAX-only install)
NO_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.path.insert(0, {root!r}); "
            "sys.argv = [{script!r}] + sys.argv[1:]; runpy.run_path({script!r}, "
            "run_name='__main__')")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_job_is_quiet_and_exports_the_policy(tmp_path):
    pytest.importorskip("wandb")
    code = NO_TORCH.format(root=str(ROOT), script=str(ROOT / "train.py"))
    result = subprocess.run([sys.executable, "-c", code, *tiny_train_args(tmp_path),
                             "--export_every", "2", "--wandb", "true", "--progress", "false"], cwd=ROOT, capture_output=True, text=True,
                            timeout=800, env={**os.environ,
                                              "WANDB_CONFIG_DIR": str(tmp_path / "wandb_cfg")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == "", result.stderr[-3000:]     # no traceback, notice or warning
    assert "Traceback" not in result.stdout and TORCH_NOTICE not in result.stdout
    run = tmp_path / "run"
    for folder in (run / "hf_model", run / "exports" / "step_2"):
        for name in ("config.json", "model.safetensors", "tokenizer.json",
                     "generation_config.json"):
            assert (folder / name).is_file(), folder / name
    generation = json.loads((run / "hf_model" / "generation_config.json").read_text())
    assert generation["max_new_tokens"] == 4 and generation["top_k"] == 0
    assert list((run / "wandb").glob("offline-run-*")), "no offline wandb run"

    # resuming with other settings: refused before any work, no traceback
    resumed = _train(*tiny_train_args(tmp_path), "--steps", "4", "--tracker.rho", "0.9",
                     "--progress", "false", "--resume", timeout=800)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr
    assert resumed.stderr.startswith("error: --resume: "), resumed.stderr
    assert "made with other settings" in resumed.stderr and "checkpoints/2" in resumed.stderr
    assert "tracker.rho: saved 0.875, expected 0.9" in resumed.stderr
    assert resumed.stderr.count("\n") == 1


def test_compilation_cache_dir_keeps_executables_and_the_environment_wins(tmp_path):
    """`compilation_cache_dir` turns on JAX's persistent cache (even this tiny program, far
    under JAX's default 1 s of compile time, lands in the folder, unless
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise); a JAX_COMPILATION_CACHE_DIR
    already set is used instead and reported."""
    code = ("import sys, jax; from rollout_bridge.run_folder import enable_compilation_cache; "
            "print(enable_compilation_cache(sys.argv[1])); jax.jit(lambda x: x * 3 + 1)(2.0).block_until_ready()")
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}

    def run(folder: Path, extra: dict) -> str:
        done = subprocess.run([sys.executable, "-c", code, str(folder)], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env={**env, **extra})
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    assert run(tmp_path / "config", {}) == str(tmp_path / "config")
    assert any((tmp_path / "config").iterdir())
    chosen = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "env"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    assert run(tmp_path / "unused", chosen) == str(tmp_path / "env")
    assert any((tmp_path / "env").iterdir()) and not (tmp_path / "unused").exists()
    assert run(tmp_path / "slow_only", {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "100"}) == str(tmp_path / "slow_only")
    assert not (tmp_path / "slow_only").exists() or not any((tmp_path / "slow_only").iterdir())


def test_a_native_crash_prints_every_threads_python_stack(tmp_path):
    """train.py enables faulthandler: a segmentation fault (XLA, a C extension) leaves the
    Python stack of every thread on stderr instead of only the shell's one-line notice."""
    import signal

    process = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *tiny_train_args(tmp_path)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first_line = process.stdout.readline()  # the job has started (imports done, logging)
        assert first_line, process.stderr.read()[-2000:]
        process.send_signal(signal.SIGSEGV)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in stderr, stderr[-2000:]
    assert "most recent call first" in stderr and "train.py" in stderr, stderr[-2000:]
