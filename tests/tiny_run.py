"""A tiny run folder for interchange tests: the HF folder a run starts from and checkpoint
steps written by the real `spopp_jax.checkpoint.Checkpointer` with the items `train.py`
saves (train_state with the published policy_event, extra `orchestrator` = tracker, raw
sampler key, counters; the JSON checkpoint key as config). Parameters are the start
model's plus noise, so an export that silently wrote the start model would be caught.

tests/test_export.py and tests/test_checkpoint_interchange.py share it; the end-to-end
version (a checkpoint from `python train.py`) is their slow test.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

NUM_TASKS = 5
SMOKE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"   # the tiny 2-turn job
PARAM_NOISE = 0.05
# The folder of generated game sets that the whole test session shares (tests/conftest.py
# sets it). A set's folder is named by its generation options and completed atomically
# (rollout_bridge/envs/textworld_games.py), so tests asking for the same set reuse it
# instead of generating it again (~1 s a game). None: each test generates under its tmp.
SHARED_GAMES_DIR: Path | None = None
TOKENIZER_TEXTS = ["open the door", "take the key", "go north", "you win"] * 4
TOKENIZER_VOCAB = 300
# What train.py's checkpoint_key(cfg) stores, trimmed to the sections export reads.
RUN_CONFIG = {
    "model": {"path": None, "tiny_dir": "unused", "compute_dtype": "float32", "param_dtype": "float32"},
    "rollout": {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 12},
    "loss": {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 2.0, "is_cap": 2.0},
    "method": "spopp",
    "seed": 0,
}


@dataclasses.dataclass
class TinyRun:
    root: Path
    model_folder: Path
    params: dict          # {dotted name: np.ndarray} saved in the newest step
    tracker: dict         # {"alpha", "beta", "z_ref"} saved in the newest step
    step: int

    @property
    def step_dir(self) -> Path:
        return self.root / "checkpoints" / str(self.step)


def make_model_folder(folder: Path, tied: bool = True, hidden_size: int = 32):
    """config.json + model.safetensors + tokenizer of a random tiny Qwen3; the model."""
    from spopp_jax.models import ModelConfig, init_model, save_pretrained

    from rollout_bridge.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(TOKENIZER_TEXTS, folder, vocab_size=TOKENIZER_VOCAB)
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         tie_word_embeddings=tied)
    model = init_model(config, seed=1)
    save_pretrained(model, str(folder))
    return model


def _noisy(params, seed: int):
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(params)
    rng = np.random.default_rng(seed)
    noisy = [x + PARAM_NOISE * rng.standard_normal(x.shape).astype(x.dtype) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, noisy)


def write_step(root: Path, model, step: int, seed: int) -> tuple[dict, dict]:
    """One checkpoint step as train.py writes it; (params by dotted name, tracker arrays)."""
    import jax
    import jax.numpy as jnp

    from spopp_jax import tracker
    from spopp_jax.checkpoint import Checkpointer
    from spopp_jax.learner import LearnerConfig, init_train_state
    from spopp_jax.models.partitioning import path_name

    _, state = init_train_state(model, LearnerConfig())
    state = dataclasses.replace(state, params=_noisy(state.params, seed),
                                policy_event=jnp.asarray(step, jnp.int32))
    rng = np.random.default_rng(seed)
    tracker_state = tracker.init(rng.uniform(0.5, 3.0, NUM_TASKS).astype(np.float32),
                                 rng.uniform(0.5, 3.0, NUM_TASKS).astype(np.float32))
    orchestrator = {  # the layout of Orchestrator.state_dict() (the method's state under "method")
        "method": {"tracker": tracker_state},
        "rng_key": np.asarray(jax.random.key_data(jax.random.key(seed))),
        "counters": {k: np.asarray(step * 4, np.int64)
                     for k in ("policy_event", "updates", "dispatched", "consumed",
                               "failed", "aborted")},
    }
    with Checkpointer(root / "checkpoints", max_to_keep=3) as checkpointer:
        checkpointer.save(step, state, {"orchestrator": orchestrator}, config=RUN_CONFIG)
    params = {path_name(p): np.asarray(x)
              for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    tracker_arrays = {name: np.asarray(getattr(tracker_state, name))
                      for name in ("alpha", "beta", "z_ref")}
    return params, tracker_arrays


def games_dir(tmp: Path) -> Path:
    """Where a test's generated TextWorld games live: the session's shared folder, else
    `tmp`/games."""
    return SHARED_GAMES_DIR if SHARED_GAMES_DIR is not None else tmp / "games"


def tiny_train_args(tmp: Path, steps: int = 2) -> list[str]:
    """`python train.py` flags of the smallest real job (configs/smoke.yaml cut to 4
    one-room games, a 1-layer 32-wide model, one checkpoint every 2 updates), everything
    under `tmp` but the games (`games_dir`)."""
    return [
        "--config_path", str(SMOKE_CONFIG),
        "--output_dir", str(tmp / "run"), "--steps", str(steps), "--checkpoint_every", "2",
        "--seed", "3", "--env.data_dir", str(games_dir(tmp)), "--env.num_games", "4",
        "--env.warmstart_games", "4", "--env.max_turns", "2", "--env.max_feedback_chars", "40",
        "--model.tiny_dir", str(tmp / "tiny"), "--model.tiny_vocab_size", "400",
        "--model.tiny_hidden_size", "32", "--model.tiny_intermediate_size", "64",
        "--model.tiny_num_layers", "1", "--model.tiny_num_heads", "2",
        "--model.tiny_num_kv_heads", "1", "--warmstart.epochs", "1",
        "--warmstart.batch_size", "4", "--prior.rollouts_per_task", "1",
        "--rollout.batch_size", "4", "--rollout.max_in_flight", "4",
        "--rollout.max_new_tokens", "4", "--rollout.max_total_tokens", "384",
    ]


def make_tiny_run(root: Path, tied: bool = True, steps: tuple[int, ...] = (2,)) -> TinyRun:
    """<root>/warmstart_model (the start folder) and checkpoint steps `steps`."""
    root.mkdir(parents=True, exist_ok=True)
    model_folder = root / "warmstart_model"
    model = make_model_folder(model_folder, tied=tied)
    params = tracker_arrays = None
    for step in steps:
        params, tracker_arrays = write_step(root, model, step, seed=step)
    return TinyRun(root, model_folder, params, tracker_arrays, steps[-1])
