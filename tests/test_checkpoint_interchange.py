"""docs/CHECKPOINTS.md's plain-orbax reader, run in a subprocess where `spopp_jax` and
`rollout_bridge` cannot be imported, restores a checkpoint step into dicts holding the
same parameters (bit for bit) and tracker state that were saved; the slow test does the
same with a checkpoint written by `python train.py` and exports it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tiny_run import NUM_TASKS, RUN_CONFIG, make_tiny_run, tiny_train_args

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "CHECKPOINTS.md"
OUR_PACKAGES = ("spopp_jax", "rollout_bridge")

# Runs the documented reader with our packages made unimportable (None in sys.modules
# makes `import` raise), then dumps what it read for the test to compare.
HARNESS = """
import json, sys
for name in {packages!r}:
    sys.modules[name] = None
import numpy as np
namespace = {{"__name__": "checkpoint_reader"}}
exec(open(sys.argv[1]).read(), namespace)
checkpoint = namespace["read_checkpoint"](sys.argv[2])
params = namespace["flat"](checkpoint["train_state"]["params"])
orchestrator = namespace["flat"](checkpoint["extra_orchestrator"]["tree"])
np.savez(sys.argv[3], **{{"params/" + k: v for k, v in params.items()}},
         **{{"orchestrator/" + k: v for k, v in orchestrator.items()}},
         step=checkpoint["train_state"]["step"],
         policy_event=checkpoint["train_state"]["policy_event"])
json.dump({{"config": checkpoint["config"], "manifest": checkpoint["manifest"],
           "step": int(checkpoint["step"]),
           "ours_imported": [m for m in {packages!r} if sys.modules.get(m) is not None]}},
          open(sys.argv[4], "w"))
"""


def documented_reader() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, f"{DOC} has no python block"
    return blocks[0]


def read_without_our_code(checkpoints_dir: Path, tmp_path: Path) -> tuple[dict, dict]:
    reader = tmp_path / "reader.py"
    reader.write_text(documented_reader())
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS.format(packages=OUR_PACKAGES))
    arrays_path, meta_path = tmp_path / "read.npz", tmp_path / "read.json"
    result = subprocess.run(
        [sys.executable, str(harness), str(reader), str(checkpoints_dir), str(arrays_path),
         str(meta_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(arrays_path) as arrays:
        return dict(arrays), json.loads(meta_path.read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_tiny_run(tmp_path_factory.mktemp("run"), steps=(2, 4))


def test_plain_orbax_reads_the_saved_parameters_and_tracker(run, tmp_path):
    arrays, meta = read_without_our_code(run.root / "checkpoints", tmp_path)
    assert meta["ours_imported"] == []
    assert meta["step"] == run.step                       # the newest step
    params = {k.removeprefix("params/"): v for k, v in arrays.items()
              if k.startswith("params/")}
    assert sorted(params) == sorted(run.params)
    for name, saved in run.params.items():
        assert params[name].dtype == saved.dtype, name
        np.testing.assert_array_equal(params[name], saved, err_msg=name)
    for name, saved in run.tracker.items():
        restored = arrays[f"orchestrator/method.tracker.{name}"]
        assert restored.shape == (NUM_TASKS,) and restored.dtype == np.float32
        np.testing.assert_array_equal(restored, saved, err_msg=name)
    assert arrays["orchestrator/rng_key"].dtype == np.uint32
    assert int(arrays["orchestrator/counters.updates"]) == run.step * 4
    assert int(arrays["policy_event"]) == run.step
    assert meta["config"] == json.loads(json.dumps(RUN_CONFIG))
    assert meta["manifest"]["extras"] == ["orchestrator"]


def test_documented_parameter_paths_match_a_checkpoint(run):
    """Every parameter path pattern in the doc's table matches a saved parameter and
    every saved parameter matches a documented pattern."""
    documented = re.findall(r"^\| `(params\.[^`]+)` \|", DOC.read_text(), flags=re.M)
    assert documented

    def pattern(row: str) -> re.Pattern:
        text = re.escape(row.removeprefix("params."))
        text = text.replace(re.escape("<i>"), r"\d+")
        text = re.sub(r"\\\{([^}]*)\\\}", lambda m: "(" + m.group(1).replace(",", "|")
                      .replace(r"\ ", "") + ")", text)
        return re.compile(text + "$")

    patterns = [pattern(row) for row in documented]
    for name in run.params:
        assert any(p.match(name) for p in patterns), f"{name} is not documented"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_py_checkpoint_reads_without_our_code_and_exports(tmp_path):
    """A checkpoint from `python train.py`: the plain-orbax reader finds the parameters and
    tracker that our own `Checkpointer.restore` finds, and the export's transformers
    logits equal our model's on them."""
    import jax

    from spopp_jax import export
    from spopp_jax.checkpoint import Checkpointer
    from spopp_jax.models.partitioning import path_name

    job = subprocess.run([sys.executable, str(ROOT / "train.py"), *tiny_train_args(tmp_path),
                          "--progress", "false", "--tensorboard", "false"],
                         cwd=ROOT, capture_output=True, text=True, timeout=800)
    assert job.returncode == 0, job.stderr[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    arrays, meta = read_without_our_code(checkpoints, tmp_path)
    assert meta["ours_imported"] == []

    with Checkpointer(checkpoints) as checkpointer:
        step_dir = checkpoints / str(checkpointer.latest_step())
        restored = checkpointer.restore(_state_target(step_dir))
    ours = {path_name(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(restored.train_state["params"])[0]}
    for name, value in ours.items():
        np.testing.assert_array_equal(arrays[f"params/{name}"], value, err_msg=name)
    tracker = restored.extras["orchestrator"]["method"]["tracker"]      # restored as saved: a dict
    for name in ("alpha", "beta", "z_ref"):
        np.testing.assert_array_equal(arrays[f"orchestrator/method.tracker.{name}"],
                                      np.asarray(tracker[name]), err_msg=name)

    out = export.export_checkpoint(step_dir, tmp_path / "hf")
    import torch
    from transformers import AutoModelForCausalLM

    ids = np.array([[3, 17, 40, 5, 99, 2]], np.int32)
    model = export.model_from_params(ours, out)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, np.asarray(model(ids)), atol=1e-5, rtol=0)


def _state_target(step_dir: Path):
    """The saved train_state's own shapes (restore as saved)."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    metadata = ocp.StandardCheckpointHandler().metadata(epath.Path(step_dir) / "train_state")
    tree = getattr(metadata, "tree", metadata)
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
