"""Malformed local inputs: config files and CLI values, HF model folders, tokenizer folders,
game / data folders. Each must end in an error that names the field or the file (an exit
status 2 and one 'error: ...' line for train.py's own checks), never a bare
traceback from a library, and must leave the inputs untouched."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from reliability_table import Row, covers
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402  (the CLI's own parse / input checks, in-process)
from rollout_bridge import components  # noqa: E402
from rollout_bridge.envs.kinds import build_env  # noqa: E402
from rollout_bridge.run_errors import run_cleanly  # noqa: E402

from rollout_bridge.envs import textworld_games  # noqa: E402
from rollout_bridge.prior import read_prior_file  # noqa: E402
from rollout_bridge.tiny_model import check_model_folder  # noqa: E402
from rollout_bridge.agent import ChatFormat  # noqa: E402
from rollout_bridge.tokenizer import build_tiny_tokenizer, load_tokenizer  # noqa: E402
from spopp_jax.models import from_pretrained, init_model, save_pretrained  # noqa: E402
from spopp_jax.models.testing import tiny_config  # noqa: E402

WEIGHTS = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class Case:
    """One malformed input: ``make(tmp_path) -> callable`` that must raise ``error``
    matching ``match``."""

    row: Row
    make: Callable[[Path], Callable[[], object]]
    error: type | tuple[type, ...]
    match: str
    stderr_has: str = ""


def check_case(case: Case, tmp_path: Path) -> None:
    action = case.make(tmp_path)
    with pytest.raises(case.error, match=case.match) as info:
        action()
    if isinstance(info.value, SystemExit):
        assert info.value.code not in (0, None)


# ------------------------------------------------------------------ config / CLI


def as_cli(action: Callable[[], object]) -> Callable[[], object]:
    """``action`` as train.py's entry point runs it (rollout_bridge.run_errors.run_cleanly): a
    user error becomes one stderr line and SystemExit(2)."""
    def run():
        code = run_cleanly(action)
        if code:
            raise SystemExit(code)

    return run


def cli(*args: str) -> Callable[[Path], Callable[[], object]]:
    return lambda tmp: as_cli(lambda: train.parse_config(list(args)))


def yaml_file(text: str) -> Callable[[Path], Callable[[], object]]:
    def make(tmp: Path):
        path = tmp / "recipe.yaml"
        path.write_text(text)
        return as_cli(lambda: train.parse_config(["--config_path", str(path)]))

    return make


def inputs(*args: str) -> Callable[[Path], Callable[[], object]]:
    """train.py's input checks before any work: the component inputs, then the env kind's
    (which refuses a missing folder before generating or loading anything)."""
    def check():
        cfg = train.parse_config(list(args))
        components.check_inputs(cfg)
        build_env(cfg, False)

    return lambda tmp: as_cli(check)


def _row(fault, behaviour, category="config / CLI",
         evidence="nothing started, no file written"):
    return Row(category, fault, behaviour, evidence)


CONFIG_CASES = [
    Case(_row("`--rollout.batch_size abc` (not an int)", "exit 2: 'config error: ...batch_size...'"),
         cli("--rollout.batch_size", "abc"), SystemExit, "2"),
    Case(_row("`--tracker.rho 1.5` (out of range)", "exit 2: 'tracker.rho must be in (0, 1)...'"),
         cli("--tracker.rho", "1.5"), SystemExit, "2"),
    Case(_row("`--method ppo` (unknown choice)", "exit 2: one line 'config error: method must be one of [...], "
              "got 'ppo'' (before: argparse's usage)"),
         cli("--method", "ppo"), SystemExit, "2", "config error: method must be one of ['event_trajectory', "),
    Case(_row("misspelt flag `--optim.learnin_rate 1e-3`", "exit 2: one line 'config error: --optim.learnin_rate: "
              "no such setting (closest: --optim.learning_rate)' (before: argparse's usage)"),
         cli("--optim.learnin_rate", "1e-3"), SystemExit, "2",
         "config error: --optim.learnin_rate: no such setting (closest: --optim.learning_rate)"),
    Case(_row("`--config_path` to a missing file", "exit 2: 'config error: ... No such file' naming it"),
         cli("--config_path", "/nonexistent/recipe.yaml"), SystemExit, "2"),
    Case(_row("YAML recipe with a syntax error", "exit 2: 'config error:' with the YAML line"),
         yaml_file("optim:\n  learning_rate: [1e-3\n"), SystemExit, "2"),
    Case(_row("YAML recipe with an unknown key", "exit 2: 'config error:' naming the key"),
         yaml_file("optim:\n  learnin_rate: 1e-3\n"), SystemExit, "2"),
    Case(_row("YAML recipe with a wrong type (`steps: many`)", "exit 2 naming `steps`"),
         yaml_file("steps: many\n"), SystemExit, "2"),
    Case(_row("`--model.path` to a folder that does not exist",
              "exit 2: 'error: model.path=... does not exist. Nothing is downloaded...'"),
         inputs("--model.path", "/nonexistent/model"), SystemExit, "2", "error: model.path="),
    Case(_row("`--env.game_dir` that does not exist",
              "exit 2: 'error: env.game_dir=... does not exist' with the ALFWorld hint",
              category="game / data folder"),
         inputs("--env.game_dir", "/nonexistent/games"), SystemExit, "2", "error: env.game_dir="),
    Case(_row("`--env math_tir --env.source dapo` with a missing data folder "
              "(parquet prompts)", "exit 2: 'error: env.data_dir=... does not exist'",
              category="game / data folder"),
         inputs("--env", "math_tir", "--env.source", "dapo", "--env.data_dir", "/nonexistent/dapo"),
         SystemExit, "2", "error: env.data_dir="),
    # every setting checked before any work: finite numbers, divisibility, the mesh, files
    Case(_row("`--optim.learning_rate inf`", "exit 2: 'optim.learning_rate must be finite, got inf' "
              "(before: an all-NaN checkpoint)"),
         cli("--optim.learning_rate", "inf"), SystemExit, "2", "optim.learning_rate must be finite, got inf"),
    Case(_row("`--warmstart.learning_rate inf`", "exit 2: 'warmstart.learning_rate must be finite' "
              "(before: a 100% NaN hf_model, exit 0)"),
         cli("--warmstart.learning_rate", "inf"), SystemExit, "2", "warmstart.learning_rate must be finite"),
    Case(_row("`--rollout.temperature inf`", "exit 2: 'rollout.temperature must be finite' (before: a late failure)"),
         cli("--rollout.temperature", "inf"), SystemExit, "2", "rollout.temperature must be finite"),
    Case(_row("`--advantage.whiten_eps inf` (every advantage 0: no learning)",
              "exit 2: 'advantage.whiten_eps must be in (0, 0.01], got inf'"),
         cli("--advantage.whiten_eps", "inf"), SystemExit, "2", "advantage.whiten_eps must be in (0, 0.01], got inf"),
    Case(_row("`--advantage.whiten_eps 0.5` (every advantage shrunk toward 0)",
              "exit 2: 'advantage.whiten_eps must be in (0, 0.01], got 0.5'"),
         cli("--advantage.whiten_eps", "0.5"), SystemExit, "2", "advantage.whiten_eps must be in (0, 0.01], got 0.5"),
    Case(_row("`--method.dual_clip nan`", "exit 2: 'method.dual_clip must be finite and > 1 or null'"),
         cli("--method.dual_clip", "nan"), SystemExit, "2", "method.dual_clip must be finite"),
    Case(_row("`--optim.num_micro_batches 3` that does not divide the batch of 16",
              "exit 2 naming both batch counts (before: a failure at RL start, after the warm start and prior)"),
         cli("--optim.num_micro_batches", "3"), SystemExit, "2", "optim.num_mini_batches x optim.num_micro_batches must be a divisor of rollout.batch_size=16"),
    Case(_row("`--steps true` (a boolean for a number)", "exit 2: '`steps`: expected a number (int), got the "
              "boolean true' (before: ran 1 step)"),
         cli("--steps", "true"), SystemExit, "2", "expected a number (int), got the boolean true"),
    Case(_row("YAML `steps: true`", "exit 2: '`steps`: expected a number (int), got the boolean true'"),
         yaml_file("steps: true\n"), SystemExit, "2", "got the boolean true"),
    Case(_row("YAML recipe: an empty file", "exit 2: '<file>: a config file must hold a mapping ..., got an "
              "empty file'"),
         yaml_file(""), SystemExit, "2", "got an empty file"),
    Case(_row("YAML recipe: a list", "exit 2: '<file>: a config file must hold a mapping ..., got a list'"),
         yaml_file("- steps\n- 3\n"), SystemExit, "2", "must hold a mapping of settings (section: value), got a list"),
    Case(_row("YAML recipe: a bare string", "exit 2: '<file>: a config file must hold a mapping ..., got a str'"),
         yaml_file("steps\n"), SystemExit, "2", "got a str"),
    Case(_row("YAML recipe with a key given twice", "exit 2: '<file>, line 3: the key 'batch_size' is given twice "
              "in one mapping (first on line 2)' (before: the later one won silently)"),
         yaml_file("rollout:\n  batch_size: 8\n  batch_size: 32\n"), SystemExit, "2",
         "recipe.yaml, line 3: the key 'batch_size' is given twice in one mapping (first on line 2)"),
    Case(_row("YAML recipe with a syntax error (line and reason)", "exit 2: '<file>, line 3, column 1: not valid "
              "YAML (while parsing a flow sequence ...)'"),
         yaml_file("optim:\n  learning_rate: [1e-3\n"), SystemExit, "2",
         "recipe.yaml, line 3, column 1: not valid YAML (while parsing a flow sequence"),
    Case(_row("`--mesh.data 2` on one device", "exit 2: 'mesh.data=2, mesh.fsdp=-1, mesh.tensor=1 do not fit the "
              "1 cpu device(s) here: ...' (before: a ValueError traceback)"),
         inputs("--mesh.data", "2"), SystemExit, "2", "mesh.data=2, mesh.fsdp=-1, mesh.tensor=1 do not fit"),
    Case(_row("`--prior.path` to a missing file", "exit 2: 'prior.path=...: no such file' before any work "
              "(before: FileNotFoundError mid-run)"),
         inputs("--prior.path", "/nonexistent/prior.json"), SystemExit, "2", "prior.path=/nonexistent/prior.json"),
]


@covers(*[c.row for c in CONFIG_CASES])
@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: c.row.fault[:40])
def test_config_and_cli(case, tmp_path, capsys):
    check_case(case, tmp_path)
    err = capsys.readouterr().err
    assert err.strip(), "exit 2 without a message on stderr"
    assert "Traceback" not in err
    assert case.stderr_has in err, err


@covers(Row("config / CLI", "`python train.py --config_path configs/smoke.yaml --optim.learning_rate inf` "
            "(and `--warmstart.learning_rate inf`), the whole command",
            "exit 2 and one stderr line 'config error: <field> must be finite, got inf', before any work",
            "no output_dir created, nothing logged on stdout"))
@pytest.mark.parametrize("field", ["optim.learning_rate", "warmstart.learning_rate"])
def test_train_py_refuses_an_infinite_learning_rate_before_any_work(field, tmp_path):
    import os
    import subprocess

    run = tmp_path / "run"
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config_path", str(ROOT / "configs" / "smoke.yaml"),
                           "--output_dir", str(run), f"--{field}", "inf"], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [f"config error: {field} must be finite, got inf"], done.stderr[-3000:]
    assert done.stdout.strip() == "" and not run.exists()


@covers(Row("config / CLI", "`python train.py --config_path configs/smoke.yaml --rollout.max_total_tokens 64 --stage prior`: "
            "every prompt longer than the sequence limit, so no prior episode finishes",
            "exit 2 and one stderr line 'config error: prior: none of the N episodes finished, so no prior was "
            "written (a prompt longer than rollout.max_total_tokens=64, ...)'",
            "no prior.json (before: one with success_rate NaN, reused by the next run); the warm start is kept"))
def test_a_prior_without_one_finished_episode_is_refused_not_saved(tmp_path):
    import os
    import subprocess

    run = tmp_path / "run"
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config_path", str(ROOT / "configs" / "smoke.yaml"),
                           "--output_dir", str(run), "--rollout.max_total_tokens", "64", "--stage", "prior",
                           "--progress", "false"], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    ours = [line for line in done.stderr.splitlines() if line.startswith("config error: prior: none of the")]
    assert len(ours) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "rollout.max_total_tokens=64" in ours[0]
    assert not (run / "prior.json").exists()
    assert (run / "warmstart_model").is_dir()


# ------------------------------------------------------------------ HF model folders


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf_model")
    save_pretrained(init_model(tiny_config("qwen3", vocab_size=300, num_hidden_layers=1)), str(folder))
    build_tiny_tokenizer(["open the door and take the key"] * 10, folder, vocab_size=300)
    from_pretrained(str(folder))  # the unmodified folder loads
    return folder


def copied(folder: Path, tmp: Path) -> Path:
    target = tmp / "model"
    shutil.copytree(folder, target)
    return target


def edit_tensors(edit: Callable[[dict], None]):
    def make(folder: Path, tmp: Path):
        target = copied(folder, tmp)
        tensors = load_file(str(target / WEIGHTS))
        edit(tensors)
        save_file(tensors, str(target / WEIGHTS))
        return lambda: from_pretrained(str(target))

    return make


def edit_folder(edit: Callable[[Path], None], load=from_pretrained):
    def make(folder: Path, tmp: Path):
        target = copied(folder, tmp)
        edit(target)
        return lambda: load(str(target))

    return make


def _drop_first_layer_norm(t):
    del t["model.layers.0.input_layernorm.weight"]


def _reshape_embedding(t):
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:-1]


def _int_embedding(t):
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].astype(np.int32)


def _config_more_layers(folder: Path):
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 2
    config.pop("layer_types", None)
    (folder / "config.json").write_text(json.dumps(config))


def _config_inconsistent(folder: Path):
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 2   # layer_types still lists 1 layer
    (folder / "config.json").write_text(json.dumps(config))


def _truncate(folder: Path):
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])


def _garbage_header(folder: Path):
    (folder / WEIGHTS).write_bytes(b"\x00" * 64)


HF = "HF model folder"
LOADS = "the folder is only read; nothing is half-loaded into a model"
HF_CASES = [
    Case(Row(HF, "a parameter tensor missing", "KeyError naming the folder and the tensor", LOADS),
         edit_tensors(_drop_first_layer_norm), KeyError, "has no tensor 'model.layers.0.input_layernorm"),
    Case(Row(HF, "an extra tensor with no parameter", "ValueError listing the unexpected tensor", LOADS),
         edit_tensors(lambda t: t.update(extra=np.zeros(3, np.float32))), ValueError,
         "no model parameter: \\['extra'\\]"),
    Case(Row(HF, "a mis-shaped tensor (embedding one row short)",
             "ValueError: 'model.embed_tokens.weight: checkpoint shape ..., model expects ...'", LOADS),
         edit_tensors(_reshape_embedding), ValueError, "embed_tokens.weight: checkpoint shape"),
    Case(Row(HF, "wrong dtype (int32 weights for a float parameter)",
             "ValueError naming the tensor, its dtype and the file", LOADS),
         edit_tensors(_int_embedding), ValueError, "embed_tokens.weight.*I32.*not a floating"),
    Case(Row(HF, "config.json says 2 layers, the weights hold 1",
             "KeyError naming the first missing layer-1 tensor", LOADS),
         edit_folder(_config_more_layers), KeyError, "model.layers.1"),
    Case(Row(HF, "config.json inconsistent (2 layers, layer_types lists 1)",
             "ValueError naming config.json and the inconsistency", LOADS),
         edit_folder(_config_inconsistent), ValueError, "config.json: ValueError: layer_types"),
    Case(Row(HF, "truncated model.safetensors (half the bytes)",
             "ValueError naming the file as unreadable safetensors", LOADS),
         edit_folder(_truncate), ValueError, "model.safetensors.*not a readable safetensors"),
    Case(Row(HF, "model.safetensors with a garbage header", "ValueError naming the file", LOADS),
         edit_folder(_garbage_header), ValueError, "model.safetensors.*not a readable safetensors"),
    Case(Row(HF, "config.json missing", "model.path check: 'lacks config.json'", LOADS),
         edit_folder(lambda f: (f / "config.json").unlink(), load=check_model_folder),
         FileNotFoundError, "lacks config.json"),
    Case(Row(HF, "config.json not valid JSON", "ValueError naming config.json and the JSON error", LOADS),
         edit_folder(lambda f: (f / "config.json").write_text("{\"hidden_size\": 6")),
         ValueError, "config.json: .*Expecting ',' delimiter"),
    Case(Row(HF, "no *.safetensors in the folder", "model.path check: 'lacks *.safetensors'", LOADS),
         edit_folder(lambda f: (f / WEIGHTS).unlink(), load=check_model_folder),
         FileNotFoundError, "lacks \\*.safetensors"),
]


# ------------------------------------------------------------------ tokenizer folders

TOK = "tokenizer folder"


def _no_tokenizer(folder: Path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink(missing_ok=True)


def _corrupt_tokenizer(folder: Path):
    (folder / "tokenizer.json").write_text("{\"version\": \"1.0\", \"model\": ")


def _no_chat_template(folder: Path):
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.pop("chat_template", None)
    path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)


def load_chat(folder: str) -> ChatFormat:
    return ChatFormat.from_tokenizer(load_tokenizer(folder))


TOKENIZER_CASES = [
    Case(Row(TOK, "no tokenizer files next to the weights", "model.path check: 'lacks tokenizer.json'",
             "nothing loaded"),
         edit_folder(_no_tokenizer, load=check_model_folder), FileNotFoundError, "lacks tokenizer.json"),
    Case(Row(TOK, "tokenizer.json truncated (invalid JSON)",
             "ValueError naming the tokenizer folder", "nothing loaded"),
         edit_folder(_corrupt_tokenizer, load=load_chat), ValueError,
         "tokenizer in .*model.* could not be loaded"),
    Case(Row(TOK, "tokenizer without a chat template", "ValueError 'tokenizer must have a chat_template'",
             "nothing loaded"),
         edit_folder(_no_chat_template, load=load_chat), ValueError,
         "chat_template"),
]


@covers(*[c.row for c in HF_CASES + TOKENIZER_CASES])
@pytest.mark.parametrize("case", HF_CASES + TOKENIZER_CASES, ids=lambda c: c.row.fault[:40])
def test_model_or_tokenizer_folder(case, model_folder, tmp_path):
    """A copy of a good tiny HF folder, damaged one way; the original is never touched."""
    action = case.make(model_folder, tmp_path)
    with pytest.raises(case.error, match=case.match):
        action()


# ------------------------------------------------------------------ game / data folders

GAMES = "game / data folder"


@covers(Row(GAMES, "an empty game folder", "FileNotFoundError 'no playable games (...) under <folder>'",
            "nothing started"))
def test_empty_game_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no playable games"):
        textworld_games.list_game_files(tmp_path)


def _truncated_story() -> bytes:
    header = bytearray(64)
    header[0] = 8                                       # Z-machine v8
    header[0x1A:0x1C] = (100_000 // 8).to_bytes(2, "big")  # declares 100 kB
    return bytes(header) + b"\x00" * 1000


@covers(Row(GAMES, "a corrupt game file (random bytes named broken.z8)",
            "ValueError naming the file before the interpreter sees it (the bundled Z-machine "
            "interpreter calls exit() on it, killing train.py: fixed); the episode fails",
            "trajectory `failed`, not trained on; the process lives"),
        Row(GAMES, "a truncated game file (header declares 100 kB, file has 1 kB)",
            "ValueError 'game file ... is truncated'", "trajectory `failed`; the process lives"))
@pytest.mark.parametrize("content", [np.random.default_rng(0).bytes(512), _truncated_story()],
                         ids=["random", "truncated"])
def test_corrupt_game_file(tmp_path, content):
    from rollout_bridge.envs.textworld_env import TextWorldTasks

    game = tmp_path / "broken.z8"
    game.write_bytes(content)
    tasks = TextWorldTasks([game], tmp_path, max_turns=2)
    with pytest.raises(ValueError, match="game file .*broken.z8.* (not a Z-machine|truncated)"):
        tasks.episode(0).reset()


@covers(Row(GAMES, "prior.json not valid JSON (`prior.path`)",
            "ValueError naming the prior file and the JSON error", "nothing started"),
        Row(GAMES, "prior.json for another task set (3 tasks, 4 expected)",
            "ValueError 'prior file ... has 3 tasks, the task set has 4'", "nothing started"),
        Row(GAMES, "prior.json without alpha0", "ValueError naming the file and the missing key",
            "nothing started"))
@pytest.mark.parametrize("content, match", [
    ("{\"alpha0\": [1, 2", "prior file .*prior.json.* is not valid JSON"),
    (json.dumps({"alpha0": [1, 1, 1], "beta0": [1, 1, 1]}), "has 3 tasks, the task set has 4"),
    (json.dumps({"beta0": [1, 1, 1, 1]}), "prior file .*prior.json.* lacks 'alpha0'"),
])
def test_malformed_prior_file(tmp_path, content, match):
    path = tmp_path / "prior.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        read_prior_file(path, 4)
    assert path.read_text() == content
