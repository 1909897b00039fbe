"""Typed configuration of a training job: pure data, validated on construction.

`TrainConfig()` with no arguments IS the main job, the agentic TextWorld job that `python
train.py` runs (written out with its reasons, field for field, in `configs/default.yaml`);
the tiny 2-turn smoke job is `configs/smoke.yaml`. Recipes are YAML files
(`configs/*.yaml`) loaded with draccus; any field is overridable on the command line as
`--section.field value` (e.g. `--rollout.batch_size 32 --tracker.rho 0.9`).

Every section checks its values in `__post_init__` and raises ValueError naming the field
as `section.field` (draccus wraps it in a ParsingError whose `__cause__` is that
ValueError; `format_config_error` extracts the message).

The run config is the application layer: the learner package `spopp_jax` never reads it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

from rollout_bridge.agent import EpisodeLimits
from rollout_bridge.engine.base import Decoding
from rollout_bridge.engine.choice import EngineConfig, engine_config
from rollout_bridge.envs.kinds.base import EnvConfig, default_env
from rollout_bridge.methods.base import MethodConfig, recipe
from rollout_bridge.orchestrator import AdvantageConfig, RolloutSchedule, SamplerConfig, TrackerConfig
from rollout_bridge.run_errors import check_setting as _check
from spopp_jax.learner import LossConfig, OptimConfig

__all__ = [
    "ModelSection", "WarmStartSection", "PriorSection", "EvaluationSection",
    "LossSection", "OptimSection", "RolloutSection",
    "NodeSection",
    "MeshSection", "TrainConfig", "load_config", "format_config_error", "config_to_dict", "ChoiceError",
    "FlagError",
]


def _check_literals(section: str, obj) -> None:
    """Literal-typed fields only take their listed values (also when loaded from YAML)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        hint = hints[f.name]
        if typing.get_origin(hint) is Optional or typing.get_origin(hint) is typing.Union:
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            if getattr(obj, f.name) is None:
                continue
            hint = args[0] if len(args) == 1 else hint
        if typing.get_origin(hint) is Literal:
            choices = typing.get_args(hint)
            value = getattr(obj, f.name)
            _check(value in choices, f"{section}.{f.name}" if section else f.name,
                   f"one of {list(choices)}", value)


_NUMBERS = (int, float)


def _refuse_booleans(number_type: type) -> None:
    """draccus turns `true` into 1 for an int or float field; the run config refuses it
    (`steps: true` is a mistake, not one step). Registered once, before any parse."""
    from draccus.parsers.decoding import decode
    from draccus.utils import DecodingError

    decode_number = decode.dispatch(number_type).func

    def strict(raw_value, path):
        if isinstance(raw_value, bool) or raw_value in ("true", "false"):
            raise DecodingError(path, f"expected a number ({number_type.__name__}), got the boolean "
                                      f"{str(raw_value).lower()}")
        return decode_number(raw_value, path)

    decode.register(number_type, strict)


for _number in _NUMBERS:
    _refuse_booleans(_number)


def _number_types(hint) -> tuple[type, ...]:
    """The number types a field's annotation allows (int / float, also inside Optional)."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return tuple(a for a in args if a in _NUMBERS)


def check_values(section: str, obj) -> None:
    """Every number of ``obj`` and the sections it nests, whatever their own checks say:
    a boolean is not a number (`steps: true` is refused, not run as 1 step), and every float
    is finite (NaN and inf refused: an infinite learning rate, temperature or advantage eps
    would end in a NaN model or in no learning at all)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        name = f"{section}.{f.name}" if section else f.name
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_values(name, value)
            continue
        numbers = _number_types(hints[f.name])
        if numbers and isinstance(value, bool):
            _check(False, name, f"a number ({' or '.join(t.__name__ for t in numbers)}), not a boolean", value)
        if isinstance(value, float):
            _check(math.isfinite(value), name, "finite", value)


def _positive(section: str, obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(value > 0, f"{section}.{name}" if section else name, "> 0", value)


@dataclass
class ModelSection:
    """The policy. `path`: a local HF model folder (config.json, *.safetensors, tokenizer);
    None = the tiny random Qwen3 model made (or reused) in `tiny_dir` from the tiny_* shape.
    No downloads happen anywhere: a missing `path` fails with a message.
    Precision: the learner keeps its weights and AdamW moments in `param_dtype` (float32
    master weights) and computes in `compute_dtype`; the rollout engines and the HF export
    get the weights in `compute_dtype`. `remat`: what the learner's backward pass recomputes
    (none / attention = the attention score blocks / block = each decoder layer);
    `attention_chunk_size`: queries per attention block."""

    path: Optional[str] = "assets/textworld_text_warmstart"
    tiny_dir: str = "runs/tiny_model_lines"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "attention", "block"] = "none"
    attention_chunk_size: int = 1024
    tiny_vocab_size: int = 1024
    tiny_hidden_size: int = 128
    tiny_intermediate_size: int = 384
    tiny_num_layers: int = 2
    tiny_num_heads: int = 4
    tiny_num_kv_heads: int = 2
    tiny_head_dim: int = 32
    seed: int = 0

    def __post_init__(self):
        _check_literals("model", self)
        _positive("model", self, "tiny_hidden_size", "tiny_intermediate_size", "tiny_num_layers",
                  "tiny_num_heads", "tiny_num_kv_heads", "tiny_head_dim", "attention_chunk_size")
        _check(self.tiny_vocab_size >= 259, "model.tiny_vocab_size",
               ">= 259 (256 bytes + 3 special tokens)", self.tiny_vocab_size)
        _check(self.tiny_num_heads % self.tiny_num_kv_heads == 0, "model.tiny_num_heads",
               f"a multiple of model.tiny_num_kv_heads={self.tiny_num_kv_heads}",
               self.tiny_num_heads)


@dataclass
class WarmStartSection:
    """Cold-start SFT on teacher demonstrations (walkthroughs of the warm-start games, never
    the training games); `loss_on`: the tokens in the loss (every token but the first by
    default; `all_assistant` = every reply, `final_message` = the last reply; warmstart.py).
    `epochs` passes over the data.
    `group_by_length`: batches of demonstrations of similar length, each padded to its own
    longest (rounded up to 128 tokens), instead of random batches padded to the longest
    demonstration of the data set; same number of steps and loss, far fewer pad tokens."""

    enabled: bool = False
    epochs: int = 48
    batch_size: int = 8
    learning_rate: float = 1e-2
    weight_decay: float = 0.0
    max_length: int = 1024
    loss_on: Literal["final_message", "all_assistant", "all_tokens"] = "all_tokens"
    group_by_length: bool = True

    def __post_init__(self):
        _check_literals("warmstart", self)
        _positive("warmstart", self, "epochs", "batch_size", "learning_rate", "max_length")
        _check(self.weight_decay >= 0, "warmstart.weight_decay", ">= 0", self.weight_decay)


@dataclass
class PriorSection:
    """Offline value prior (SPEC 2): `rollouts_per_task` rollouts per task with the initial
    (warm-started) policy; Jeffreys Beta(s+1/2, n-s+1/2) rescaled to total mass `mass`
    (None = 1/(1-rho) = 8). `path`: reuse this prior file instead of computing one.
    `cache_dir`: keep the prior's rollouts and the evaluations before RL of the initial
    policy in this folder, keyed by everything that decides them (policy content, task
    sets, agent/sampling/engine settings, seed, episodes), and read them there when a
    run (another output_dir, other RL settings) has the same key; None: no cache."""

    enabled: bool = True
    rollouts_per_task: int = 1
    mass: Optional[float] = None
    path: Optional[str] = None
    cache_dir: Optional[str] = "artifacts/evaluations"

    def __post_init__(self):
        _positive("prior", self, "rollouts_per_task")
        if self.mass is not None:
            _check(self.mass > 0 and math.isfinite(self.mass), "prior.mass", "> 0", self.mass)


@dataclass
class EvaluationSection:
    """The job's evaluations with common random numbers (per-game pairs of the same
    episodes' seeds). `train_rollouts`: rollouts of every training task with the final
    policy, compared with the prior's rollouts of the initial policy;
    `heldout_rollouts`: rollouts of every task of the env kind's evaluation sets (held-out
    games, Math-TIR without its tool) before and after RL. Either None:
    `prior.rollouts_per_task` (the default of `train_rollouts`; `heldout_rollouts` defaults to 4).
    `train_games`: only the training tasks 0..train_games-1 are evaluated after RL (paired
    with the prior's rollouts of the same tasks; default 256); None: every training task."""

    train_rollouts: Optional[int] = None
    heldout_rollouts: Optional[int] = 4
    train_games: Optional[int] = 256

    def __post_init__(self):
        _positive("evaluation", self, *(name for name in ("train_rollouts", "heldout_rollouts", "train_games")
                                        if getattr(self, name) is not None))

    def train_task_ids(self, num_tasks: int) -> range:
        """The training tasks evaluated after RL: the first `train_games` (all if None or more)."""
        return range(num_tasks if self.train_games is None else min(self.train_games, num_tasks))

    def rollouts(self, prior: "PriorSection", which: str) -> int:
        """Rollouts per task of ``which`` ("train" or "heldout")."""
        value = {"train": self.train_rollouts, "heldout": self.heldout_rollouts}[which]
        return prior.rollouts_per_task if value is None else value


@dataclass(frozen=True)
class LossSection(LossConfig):
    """SPEC 5: the learner's loss fields (`spopp_jax.learner.LossConfig`, declared and
    defaulted there), checked here by their config names."""

    def __post_init__(self):
        _check_literals("loss", self)
        _check(0.0 < self.clip_low < 1.0, "loss.clip_low", "in (0, 1)", self.clip_low)
        _positive("loss", self, "clip_high", "is_cap")


@dataclass(frozen=True)
class OptimSection(OptimConfig):
    """AdamW and the update's mini- / micro-batches: the learner's optimizer fields
    (`spopp_jax.learner.OptimConfig`, declared and defaulted there; `build()` is the optax
    transform), checked here by their config names."""

    def __post_init__(self):
        _positive("optim", self, "learning_rate", "num_micro_batches", "num_mini_batches", "adam_eps",
                  "max_consecutive_skips")
        for name in ("adam_b1", "adam_b2"):
            _check(0.0 <= getattr(self, name) < 1.0, f"optim.{name}", "in [0, 1)", getattr(self, name))
        for name in ("logprob_chunk_size", "length_bucket"):
            if getattr(self, name) is not None:
                _positive("optim", self, name)
        if self.action_logits_fraction is not None:
            _check(0.0 < self.action_logits_fraction <= 1.0, "optim.action_logits_fraction", "in (0, 1]",
                   self.action_logits_fraction)
        _check(self.weight_decay >= 0, "optim.weight_decay", ">= 0", self.weight_decay)
        if self.max_grad_norm is not None:
            _positive("optim", self, "max_grad_norm")


_GPU_LIST = re.compile(r"^\s*\d+(\s*,\s*\d+)*\s*$")


@dataclass
class NodeSection:
    """How train.py shares this node's GPUs with the vLLM servers it launches, and JAX's
    memory settings; applied before JAX initialises (rollout_bridge/node_layout.py).
    `learner_gpus`: the GPU ids the learner uses ("0", "0,1"; null: those below
    rollout.engine.launch.first_gpu when launched servers use GPUs, else every GPU).
    GPU ids are positions among the GPUs train.py was given (its CUDA_VISIBLE_DEVICES).
    `jax_preallocate`: XLA_PYTHON_CLIENT_PREALLOCATE (null: false when vLLM shares the
    node, rollout.engine vllm or launched servers; else JAX's default). `jax_mem_fraction`:
    XLA_PYTHON_CLIENT_MEM_FRACTION in (0, 1] (null: JAX's default)."""

    learner_gpus: Optional[str] = None
    jax_preallocate: Optional[bool] = None
    jax_mem_fraction: Optional[float] = None

    def __post_init__(self):
        if self.learner_gpus is not None:
            _check(bool(_GPU_LIST.match(str(self.learner_gpus))), "node.learner_gpus",
                   "a ','-separated list of GPU ids, e.g. 0 or 0,1", self.learner_gpus)
        if self.jax_mem_fraction is not None:
            _check(0.0 < self.jax_mem_fraction <= 1.0, "node.jax_mem_fraction", "in (0, 1] or null",
                   self.jax_mem_fraction)


@dataclass(frozen=True)
class RolloutSection(RolloutSchedule, EpisodeLimits, Decoding):
    """Rollout engine, scheduling and decoding: the orchestrator's `RolloutSchedule`, the
    agent's `EpisodeLimits` and the engine's `Decoding` (each field declared and defaulted
    there) and the engine choice (`engine`, last below). `batch_size` trajectories per update
    (SPEC 3), `publish_every` updates per policy event, `max_in_flight` concurrent episodes,
    `max_in_flight_per_task` m (SPEC 2: 1; m > 1 places siblings by `sibling_rule`, see
    rollout_bridge/orchestrator.py), `max_buffered_batches`: dispatch only while
    finished-but-unconsumed plus in-flight trajectories < this x batch_size (bounds policy
    lag), `drain` of old-policy work on publish (SPEC 3; "none": in-flight publish, the
    engine installs new weights between decode steps and nothing is drained),
    `max_policy_lag`: a request still in flight after a publish whose policy lag (events
    since its dispatch) exceeds this is aborted and its task freed, `train_on_failed`: failed
    episodes (env error / time-out, R = 0) are training samples, `env_timeout_s` bounds
    each environment call (null: none), `max_consecutive_failures` stops a run whose
    env/engine is broken. `pad_to_multiple` (a divisor of max_total_tokens): learner batches are
    [B, T] with T the longest trajectory rounded up to this multiple (null: T = max_total_tokens
    always, one compile; with `optim.length_bucket` the micro-batches run at their own lengths
    whatever the width; without it a smaller multiple trains short batches faster at the cost
    of one compile per width). `pack_rows`: several trajectories share a learner row (rows at most
    max_total_tokens wide, each trajectory attending only to itself): the [R, W] of least padded
    area, R a multiple of optim mini- x micro-batches, so fewer padding tokens are trained
    (same loss and gradient; a few more shapes to compile; docs/PERFORMANCE.md).
    `result_delay_s` (an experiment knob; 0 = off): each finished episode is held a seeded
    U(0, result_delay_s) seconds before the orchestrator receives it, as a fleet's uneven
    latency would, so results come back out of event order on one machine (the regime
    where the receipt-order and event-time trackers differ; rollout_bridge/orchestrator.py).
    `engine`: the rollout engine, a choice with its own fields (`rollout_bridge.engine.choice`):
    `jax` (the embedded engine, `JaxEngineConfig`), `vllm` (vLLM in this process) or
    `vllm_server` (vLLM servers by URL or launched here, `VllmServerEngineConfig`), and any
    engine file added there: `--rollout.engine vllm_server --rollout.engine.server_urls URL`."""

    engine: EngineConfig = field(default_factory=lambda: engine_config(EngineConfig.default_choice_name()))

    def __post_init__(self):
        _check_literals("rollout", self)
        _positive("rollout", self, "batch_size", "publish_every", "max_in_flight",
                  "max_in_flight_per_task", "max_buffered_batches", "max_consecutive_failures",
                  "temperature", "max_new_tokens", "max_total_tokens")
        if self.env_timeout_s is not None:
            _positive("rollout", self, "env_timeout_s")
        if self.pad_to_multiple is not None:
            _check(self.pad_to_multiple > 0 and self.max_total_tokens % self.pad_to_multiple == 0,
                   "rollout.pad_to_multiple", f"null or a divisor of rollout.max_total_tokens={self.max_total_tokens}",
                   self.pad_to_multiple)
        _check(self.max_policy_lag >= 0, "rollout.max_policy_lag", ">= 0", self.max_policy_lag)
        _check(math.isfinite(self.result_delay_s) and self.result_delay_s >= 0, "rollout.result_delay_s",
               "finite and >= 0", self.result_delay_s)
        _check(0.0 < self.top_p <= 1.0, "rollout.top_p", "in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k > 0, "rollout.top_k", "-1 or > 0", self.top_k)
        _check(self.max_new_tokens < self.max_total_tokens, "rollout.max_new_tokens",
               f"< rollout.max_total_tokens={self.max_total_tokens}", self.max_new_tokens)


@dataclass
class MeshSection:
    """Device mesh (data, fsdp, tensor); -1 on one axis = all remaining devices."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def __post_init__(self):
        for name in ("data", "fsdp", "tensor"):
            value = getattr(self, name)
            _check(value == -1 or value > 0, f"mesh.{name}", "-1 or > 0", value)
        _check([self.data, self.fsdp, self.tensor].count(-1) <= 1, "mesh",
               "at most one axis of -1", (self.data, self.fsdp, self.tensor))


@dataclass
class TrainConfig:
    """One training job. Defaults = the main job, the agentic TextWorld job (configs/default.yaml);
    the tiny 2-turn smoke job is configs/smoke.yaml.

    `method`: the method and its recipe (`rollout_bridge.methods`: spopp, spo, grpo, rloo,
    the 2x2 cells event_trajectory, receipt_token, receipt_trajectory, and any method file
    added there); `--method spo` is SPO's whole recipe, `--method.dual_clip 5` one field of
    it. `env`: the env kind and its tasks (`rollout_bridge.envs.kinds`: textworld, alfworld,
    math_tir, and any kind file added there); `--env alfworld` selects a kind, `--env.num_games 64`
    one field of it. `stage`: all = warm start, prior, RL (each stage
    reuses its output when present); warmstart / prior / rl run one stage.
    `steps` updates of `rollout.batch_size` trajectories; a checkpoint every
    `checkpoint_every` updates (and at the end) in `output_dir/checkpoints`, keeping
    `keep_checkpoints`; `resume=true` continues from the newest one.
    The final policy is exported as a HF folder to `output_dir/hf_model`; with
    `export_every` (a multiple of checkpoint_every) also `output_dir/exports/step_<k>`.
    `wandb`: also log the metrics to Weights & Biases (`wandb_mode` offline = on disk under
    `output_dir/wandb`, no account needed; the `wandb` extra).
    `compilation_cache_dir`: JAX's persistent compilation cache (every XLA executable is
    stored there, unless `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` sets a minimum, and read
    back by later runs of the same programs: a rerun, `--resume`, another seed of a matched
    run); None: none. A `JAX_COMPILATION_CACHE_DIR` in the environment takes precedence.
    `program_store`: with that cache on, also keep the programs a run traces (the embedded
    engine's prefill programs, the RL learner's step and log-prob programs) exported in its
    `prefill_programs` and `learner_programs` folders, keyed by the source and versions they
    are made from, so a later run compiles them without tracing (`rollout_bridge.program_store`);
    false while editing code the model calls outside `spopp_jax`, `rollout_bridge` and its
    own classes' files, which the key does not cover.
    """

    method: MethodConfig = field(default_factory=lambda: recipe(MethodConfig.default_choice_name()))
    stage: Literal["all", "warmstart", "prior", "rl"] = "all"
    seed: int = 0
    steps: int = 120
    output_dir: str = "runs/default"
    resume: bool = False
    resume_step: Optional[int] = None  # with --resume: continue from this checkpoint step, not the newest intact one
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    progress: bool = True
    tensorboard: bool = True
    export_every: Optional[int] = None
    wandb: bool = False
    wandb_mode: Literal["offline", "online"] = "offline"
    wandb_project: str = "spopp-jax"
    compilation_cache_dir: Optional[str] = "artifacts/jax_compilation_cache"
    program_store: bool = True
    model: ModelSection = field(default_factory=ModelSection)
    env: EnvConfig = field(default_factory=default_env)
    warmstart: WarmStartSection = field(default_factory=WarmStartSection)
    prior: PriorSection = field(default_factory=PriorSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossSection = field(default_factory=LossSection)
    optim: OptimSection = field(default_factory=OptimSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    node: NodeSection = field(default_factory=NodeSection)  # GPUs of learner and launched servers

    def __post_init__(self):
        check_values("", self)
        _check_literals("", self)
        _positive("", self, "steps", "checkpoint_every", "keep_checkpoints")
        _check(self.seed >= 0, "seed", ">= 0", self.seed)
        _check(bool(self.output_dir), "output_dir", "non-empty", self.output_dir)
        self.method.check(self)
        if self.export_every is not None:
            _check(self.export_every > 0 and self.export_every % self.checkpoint_every == 0,
                   "export_every", f"a positive multiple of checkpoint_every="
                   f"{self.checkpoint_every} (exports are made at checkpoints) or null",
                   self.export_every)
        _check(self.checkpoint_every % self.rollout.publish_every == 0, "checkpoint_every",
               f"a multiple of rollout.publish_every={self.rollout.publish_every} (a checkpoint "
               "holds exactly the published policy)", self.checkpoint_every)
        rows = self.optim.num_mini_batches * self.optim.num_micro_batches
        _check(self.rollout.batch_size % rows == 0, "optim.num_mini_batches x optim.num_micro_batches",
               f"a divisor of rollout.batch_size={self.rollout.batch_size} (each mini-batch is split into "
               f"micro-batches)", f"{self.optim.num_mini_batches} x {self.optim.num_micro_batches} = {rows}")

    @property
    def prior_mass(self) -> float:
        """SPEC 2: M = 1/(1-rho) unless prior.mass says otherwise."""
        return self.prior.mass if self.prior.mass is not None else 1.0 / (1.0 - self.tracker.rho)


def config_value(config, path: str):
    """The value at dotted ``path`` ("rollout.batch_size") of a config."""
    for name in path.split("."):
        config = getattr(config, name)
    return config


def config_to_dict(config: TrainConfig) -> dict:
    """The run config as plain data; the choice sections (method, env, rollout.engine) with
    their ``type`` (parses back)."""
    out = dataclasses.asdict(config)
    out["method"] = config.method.to_dict()
    out["env"] = config.env.to_dict()
    out["rollout"]["engine"] = config.rollout.engine.to_dict()
    return out


CONFIG_FLAG = "--config_path"
ENGINE_FLAG = "--rollout.engine"
# the choice sections by dotted name, each with the registry of its choices
CHOICE_SECTIONS = {"method": MethodConfig, "env": EnvConfig, "rollout.engine": EngineConfig}
CHOICE_FLAGS = tuple(f"--{name}" for name in CHOICE_SECTIONS)   # `--<choice> X` selects X (`--<choice>.type X`)


def _normalize_flags(args: Sequence[str]) -> list[str]:
    """`--resume` alone means `--resume true` (draccus wants a value for bools);
    `--method X` / `--env X` / `--rollout.engine X` select the choice section's X
    (`--method.type X`)."""
    out = list(args)
    for i, arg in enumerate(out):
        nxt = out[i + 1] if i + 1 < len(out) else None
        name = arg.split("=", 1)[0]
        if arg == "--resume" and (nxt is None or nxt.startswith("--")):
            out[i] = "--resume=true"
        elif name in CHOICE_FLAGS:
            out[i] = f"{name}.type" + arg[len(name):]
    return out


def _split_config_path(args: list[str]) -> tuple[list[str], str | None]:
    """`--config_path F` (or `=F`) taken out of the flags: the file is read here, strictly."""
    rest, path, i = [], None, 0
    while i < len(args):
        if args[i] == CONFIG_FLAG and i + 1 < len(args):
            path, i = args[i + 1], i + 2
            continue
        if args[i].startswith(CONFIG_FLAG + "="):
            path = args[i].split("=", 1)[1]
        else:
            rest.append(args[i])
        i += 1
    return rest, path


class ConfigFileError(ValueError):
    """A config file that is not a YAML mapping of settings (names file, line and reason)."""


def read_config_file(path: str | os.PathLike) -> dict:
    """The settings of a YAML config file, read strictly: a syntax error, a key given twice
    in one mapping, or a document that is not a mapping (an empty file, a list, a bare
    value) raise ConfigFileError naming the file, the line and the reason."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigFileError(f"{path}, line {key_node.start_mark.line + 1}: the key {key!r} is given twice "
                                      f"in one mapping (first on line {seen[key]})")
            seen[key] = key_node.start_mark.line + 1
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=StrictLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        reason = " ".join(str(part) for part in (error.context, error.problem) if part)
        raise ConfigFileError(f"{path}{where}: not valid YAML ({reason})") from None
    except yaml.YAMLError as error:
        raise ConfigFileError(f"{path}: not valid YAML ({error})") from None
    except UnicodeDecodeError as error:
        raise ConfigFileError(f"{path}: not a text file ({error.reason})") from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {type(data).__name__} ({str(data)[:40]!r})"
        raise ConfigFileError(f"{path}: a config file must hold a mapping of settings (section: value), got {got}")
    if isinstance(data.get("env"), str):   # `env: alfworld` = that kind with its defaults
        data["env"] = {"type": data["env"]}
    if isinstance(data.get("method"), str):   # `method: spo` = the recipe of spo
        data["method"] = {"type": data["method"]}
    rollout = data.get("rollout")
    if isinstance(rollout, dict) and isinstance(rollout.get("engine"), str):   # `engine: jax`: its defaults
        rollout["engine"] = {"type": rollout["engine"]}
    return data


class ChoiceError(ValueError):
    """A method, env kind or engine no module registered (names the registered ones), or a
    setting of another engine than the chosen one (names the engines that have it)."""


def _flag_values(args: Sequence[str], flag: str) -> list[str]:
    """The values given to ``flag`` (``--a.b v`` or ``--a.b=v``), in order."""
    return [args[i + 1] if a == flag else a.split("=", 1)[1] for i, a in enumerate(args)
            if (a == flag and i + 1 < len(args)) or a.startswith(flag + "=")]


def _file_section(settings: dict | None, dotted: str) -> dict:
    """The mapping at ``dotted`` ("rollout.engine") of a config file's settings ({} if none)."""
    holder = settings
    for part in dotted.split("."):
        holder = holder.get(part) if isinstance(holder, dict) else None
    return holder if isinstance(holder, dict) else {}


def _check_choice_names(args: Sequence[str], settings: dict | None, path: str | os.PathLike | None) -> None:
    """Every choice named on the command line (`--method X`, `--env.type X`) or in the file
    (`method: X`, `env: {type: X}`) is registered: else one line naming the value, the
    registered choices and the file (argparse would print its usage first, draccus a chain)."""
    for dotted, registry in CHOICE_SECTIONS.items():
        known = sorted(registry.get_known_choices())
        section = _file_section(settings, dotted)
        named = [(f"config file {path}: ", section["type"])] if "type" in section else []
        named += [("", name) for name in _flag_values(args, f"--{dotted}.type")]
        for source, name in named:
            if name not in known:
                raise ChoiceError(f"{source}{dotted} must be one of {known}, got {name!r}")


def _has_setting(section: type, dotted: str) -> bool:
    """Whether the config dataclass `section` has the (nested) field `dotted`."""
    for part in dotted.split("."):
        if not (isinstance(section, type) and dataclasses.is_dataclass(section)
                and part in {f.name for f in dataclasses.fields(section)}):
            return False
        section = typing.get_type_hints(section)[part]
    return True


def _check_engine_fields(args: Sequence[str], settings: dict | None) -> None:
    """Every `rollout.engine.<field>` given is a field of the chosen engine: else one line
    naming the engines that have it."""
    from rollout_bridge.engine.choice import engine_names

    section = _file_section(settings, "rollout.engine")
    names = ([section["type"]] if "type" in section else []) + _flag_values(args, f"{ENGINE_FLAG}.type")
    chosen = names[-1] if names else EngineConfig.default_choice_name()
    given = [a[len(ENGINE_FLAG) + 1:].split("=", 1)[0] for a in args if a.startswith(ENGINE_FLAG + ".")]
    if section.get("type", EngineConfig.default_choice_name()) == chosen:   # else the file's section is replaced
        given += list(section)
    engines = {name: EngineConfig.get_choice_class(name) for name in engine_names()}
    for dotted in given:
        if dotted.split(".")[0] != "type" and not _has_setting(engines[chosen], dotted):
            owners = [name for name, engine in engines.items() if _has_setting(engine, dotted)]
            if owners:
                raise ChoiceError(f"rollout.engine.{dotted} is a setting of rollout.engine "
                                  f"{' / '.join(owners)}, not of the chosen rollout.engine {chosen} "
                                  f"(select it with --rollout.engine {owners[0]})")


def _choices_given_replace_the_files(args: Sequence[str], settings: dict) -> None:
    """A choice the command line selects (`--rollout.engine vllm_server`) other than the
    file's replaces the file's section: the file's fields belong to the choice it named."""
    for flag in CHOICE_FLAGS:
        chosen = _flag_values(args, f"{flag}.type")
        *parents, name = flag[2:].split(".")
        holder = settings
        for part in parents:
            holder = holder.get(part) if isinstance(holder, dict) else None
        section = holder.get(name) if isinstance(holder, dict) else None
        if chosen and isinstance(section, dict) and section.get("type") != chosen[-1]:
            holder[name] = {"type": chosen[-1]}


def load_config(args: Sequence[str] = (), config_path: str | os.PathLike | None = None
                ) -> TrainConfig:
    """TrainConfig from an optional YAML file (or `--config_path` in args) plus overrides.

    Raises ConfigFileError for a file that is not a YAML mapping (`read_config_file`),
    ChoiceError for a method, env kind or engine nobody registered or a field of another
    engine than the chosen one, FlagError for what argparse refuses (a flag no setting has,
    a value outside a setting's choices) and draccus.utils.ParsingError for bad values (see
    `format_config_error`).
    """
    import json
    import tempfile

    args, given = _split_config_path(_normalize_flags(args))
    path = given if config_path is None else config_path
    settings = None if path is None else read_config_file(path)
    _check_choice_names(args, settings, path)
    _check_engine_fields(args, settings)
    if settings is not None:
        _choices_given_replace_the_files(args, settings)
    if settings is None:
        return _parse(None, args)
    with tempfile.TemporaryDirectory(prefix="spopp-config-") as folder:
        checked = os.path.join(folder, "config.json")   # the checked settings, as draccus reads files
        with open(checked, "w") as f:
            json.dump(settings, f)
        return _parse(checked, args)


class FlagError(ValueError):
    """A command line argparse refuses, in one line instead of its usage: a flag no setting
    has (with the closest flags), a value outside a setting's choices, a flag without its
    value."""


UNRECOGNIZED = "unrecognized arguments: "   # how draccus words argparse's leftover arguments
CLOSEST_FLAGS = 2
CLOSE_ENOUGH = 0.8   # difflib ratio: a typo of a flag, not another flag of the section


def _parse(config_path: str | None, args: Sequence[str]) -> TrainConfig:
    """draccus' parse of ``args`` over the file ``config_path``; its --help lists settings
    only (`_help_lists_settings_only`); what argparse refuses raises FlagError."""
    import argparse

    from draccus.argparsing import ArgumentParser
    from draccus.utils import DraccusException, ParsingError

    parser = ArgumentParser(TrainConfig, config_path=config_path, exit_on_error=False)
    _help_lists_settings_only(parser.parser)
    try:
        return parser.parse_args(args)
    except argparse.ArgumentError as error:
        raise FlagError(str(error)) from None
    except DraccusException as error:
        if isinstance(error, ParsingError) or not str(error).startswith(UNRECOGNIZED):
            raise
        raise FlagError(_unknown_flags_line(str(error)[len(UNRECOGNIZED):].split(), parser.parser)) from None


def _unknown_flags_line(tokens: Sequence[str], parser) -> str:
    """'--a.b: no such setting (closest: --a.c)' for each flag in argparse's leftover
    ``tokens`` (the values after them are left out), or the leftover words."""
    import argparse

    known = [option for action in parser._actions if action.help != argparse.SUPPRESS
             for option in action.option_strings if option.startswith("--")]
    flags = [token.split("=", 1)[0] for token in tokens if token.startswith("--")]
    if not flags:
        return f"unexpected arguments {' '.join(tokens)!r}: settings are given as --section.field value"
    parts = []
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=CLOSEST_FLAGS, cutoff=CLOSE_ENOUGH)
        parts.append(f"{flag}: no such setting" + (f" (closest: {' or '.join(close)})" if close else ""))
    return "; ".join(parts) + " (python train.py --help lists them)"


SECTION_FILE_HELP = "Config file for "   # how draccus' help starts for the flag it adds per section


def _help_lists_settings_only(parser) -> None:
    """draccus adds a flag per section (``--rollout str  Config file for rollout``) that takes
    no file (only ``"include <file>"``), listed twice for a top-level section, and for a
    section nested deeper (rollout.engine's ``launch``) a second one under its bare name
    (``--launch``), which names nothing: --help leaves them out. The choice sections' flags
    select a choice (``--method spo``, `_normalize_flags`) and say so."""
    import argparse

    choices = {f"--{name}": name for name in CHOICE_SECTIONS}
    for group in parser._action_groups:
        for action in group._group_actions:
            if not str(action.help or "").startswith(SECTION_FILE_HELP):
                continue
            flag = next((option for option in action.option_strings if option in choices), None)
            if flag is None:
                action.help = argparse.SUPPRESS
                continue
            registry = CHOICE_SECTIONS[choices[flag]]
            action.help = (f"one of {sorted(registry.get_known_choices())} (default "
                           f"{registry.default_choice_name()}); the same as {flag}.type")
            action.default = argparse.SUPPRESS   # no "(default: None)" added to the help


def format_config_error(error: BaseException) -> str:
    """The innermost ValueError/TypeError message of a draccus ParsingError chain, on one line."""
    message = str(error)
    cause = error.__cause__ or error.__context__
    while cause is not None:
        if isinstance(cause, (ValueError, TypeError)):
            message = str(cause)
        cause = cause.__cause__ or cause.__context__
    return " ".join(message.split())
