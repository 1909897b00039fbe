"""docs/CHECKPOINTS.md, its plain-orbax reader and what train.py saves agree.

The checkpoint here is written the way train.py writes one (`Checkpointer.save` of the
learner's state with `{"orchestrator": Orchestrator.state_dict()}` and `checkpoint_key`),
from a real `Orchestrator` of the smoke job (method spopp) and a tiny model, without
running rollouts. The doc's generated `extra_orchestrator` table
(scripts/checkpoint_tree.py) must list exactly its leaves and dtypes, and the doc's
reader, run as a script where our packages cannot be imported, must read its tracker.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "CHECKPOINTS.md"
sys.path.insert(0, str(ROOT / "scripts"))
import checkpoint_tree  # noqa: E402

NUM_TASKS = 4
STEP = 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import train
    from rollout_bridge import components
    from rollout_bridge.policy_learner import saved_state
    from rollout_bridge.run_folder import checkpoint_key
    from rollout_bridge.orchestrator import Orchestrator
    from spopp_jax.checkpoint import Checkpointer
    from spopp_jax.learner import LearnerConfig, init_train_state
    from spopp_jax.models import init_model
    from spopp_jax.models.testing import tiny_config

    cfg = train.parse_config(["--config_path", "configs/smoke.yaml"])
    agent = components.build_agent_config(cfg, max_turns=2)
    engine = types.SimpleNamespace(supports_inflight_publish=True, policy_event=0)  # never called
    orchestrator = Orchestrator(engine, None, None, None, NUM_TASKS,
                                components.build_orchestrator_config(cfg, agent, cfg.seed), agent)
    _, state = init_train_state(init_model(tiny_config("qwen3", num_hidden_layers=1), seed=0), LearnerConfig())
    folder = tmp_path_factory.mktemp("run") / "checkpoints"
    extras = {"orchestrator": orchestrator.state_dict()}
    with Checkpointer(folder) as checkpointer:  # as rl_stage -> PolicyLearner.save
        checkpointer.save(STEP, saved_state(state, extras), extras, config=checkpoint_key(cfg))
    return folder


def test_doc_table_lists_what_train_py_saves(checkpoints):
    rows = checkpoint_tree.leaf_rows(checkpoint_tree.newest_step(checkpoints))
    assert ("tree.method.tracker.alpha", "float32", f"[{NUM_TASKS}]") in rows
    assert checkpoint_tree.differences(DOC.read_text(), rows) == []


def test_documented_reader_reads_the_tracker_without_our_code(checkpoints, tmp_path):
    reader = tmp_path / "reader.py"
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    blocked = "import sys\nfor _name in ('spopp_jax', 'rollout_bridge'):\n    sys.modules[_name] = None\n"
    reader.write_text(blocked + code)
    done = subprocess.run([sys.executable, str(reader), str(checkpoints)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"step {STEP}:" in done.stdout and f"{NUM_TASKS} tasks" in done.stdout


def test_check_mode_flags_a_stale_doc(checkpoints, tmp_path):
    stale = tmp_path / "stale.md"
    stale.write_text(DOC.read_text().replace("tree.method.tracker.alpha", "tree.tracker.alpha"))
    assert checkpoint_tree.main([str(checkpoints), "--check", str(stale)]) == 1
    assert checkpoint_tree.main([str(checkpoints), "--check", str(DOC)]) == 0
