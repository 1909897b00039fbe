"""Trained policies out as Hugging Face folders (config, safetensors, tokenizer, generation config).

    python -m spopp_jax.export --checkpoint runs/x/checkpoints/160 --out runs/x/hf_160

A checkpoint step holds the learner's parameters (orbax item ``train_state``, leaf
``params``; docs/CHECKPOINTS.md) but not the architecture or the tokenizer: those come
from the HF folder the run started from (``--model``; by default the run's
``warmstart_model`` folder, else the checkpoint config's ``model.path``, else its
``model.tiny_dir``). The parameters are checked name by name and shape by shape against
that folder's ``config.json`` before anything is written; a partial checkpoint (an
interrupted save, a missing item, unreadable array data) or a mismatched one is refused
with a message naming the step folder and each difference.

The step's files are checked against the checksums written with it
(``checksums.json``, `spopp_jax.checkpoint_integrity`) and parameters holding NaN or ±inf
are refused (`NonFiniteStateError`): a damaged or diverged step is never exported.
``--out`` may not be a training run's folder, a folder holding checkpoints, or a folder
that contains the checkpoint being exported, ``--overwrite`` or not: replacing it would
delete the run.

The output folder is written next to its final place and renamed into it when complete,
so a crash never leaves a half-written model where transformers / vLLM would load it.
Only the policy parameters are read (a partial orbax restore): the optimizer state, twice
the size of the parameters, is never loaded.

``generation_config.json`` holds the tokenizer's bos/eos/pad ids and the run's sampling
settings (``rollout.temperature/top_p/top_k/max_new_tokens``), so ``model.generate`` and
vLLM sample as the rollouts did. Our ``top_k = -1`` (off) is written as HF's ``0`` (off).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spopp_jax.checkpoint import CheckpointCorruptError, CheckpointMismatchError, NonFiniteStateError
from spopp_jax.checkpoint_integrity import find_damage, non_finite_leaves

__all__ = [
    "IncompleteCheckpointError", "CheckpointMismatchError", "CheckpointCorruptError", "NonFiniteStateError",
    "SamplingDefaults", "refuse_run_folder", "check_finite",
    "TOKENIZER_FILES", "check_step_complete", "read_step_config", "read_step_params",
    "resolve_model_folder", "model_from_params", "generation_config", "export_model", "export_checkpoint", "main",
]

TRAIN_STATE_ITEM = "train_state"
CONFIG_ITEM = "config"
MANIFEST_ITEM = "manifest"
PARAMS_KEY = "params"
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"   # orbax writes it when a step is finalized
PYTREE_METADATA_FILE = "_METADATA"            # per StandardSave item
JSON_ITEM_FILE = "metadata"                   # per JsonSave item
WARMSTART_FOLDER = "warmstart_model"          # train.py's RunPaths.warmstart_model
GENERATION_CONFIG_FILE = "generation_config.json"
# What marks a training run's folder (train.py's RunPaths and run lock) or a checkpoint
RUN_FOLDER_MARKERS = ("checkpoints", "metrics.jsonl", "prior.json", "summary.json", "warmstart_checkpoints",
                      ".spopp-run.lock", "run_config.json", "checkpoints_set_aside")
# Tokenizer files a HF folder may carry; the ones present are copied byte for byte.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json",
    "merges.txt", "tokenizer.model",
)
HF_TOP_K_OFF = 0      # transformers / vLLM: top_k 0 = no top-k filtering
OUR_TOP_K_OFF = -1    # rollout_bridge.config.RolloutSection.top_k: -1 = off
EXIT_USAGE = 2        # exit status of a refused export (bad input, like argparse)
MESSAGE_CHARS = 300   # longest third-party error text quoted in our one-line message


class IncompleteCheckpointError(FileNotFoundError):
    """The step folder is not a complete orbax checkpoint step (interrupted or damaged)."""


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    """Sampling written to generation_config.json (our RolloutSection's meaning)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = OUR_TOP_K_OFF
    max_new_tokens: int | None = None

    @classmethod
    def from_run_config(cls, saved: Mapping[str, Any]) -> "SamplingDefaults":
        """From a checkpoint's saved config (its ``rollout`` section); defaults if absent."""
        rollout = saved.get("rollout") or {}
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in rollout.items() if k in fields})


# ----------------------------------------------------------------------------- reading a step


def check_step_complete(step_dir: str | os.PathLike) -> Path:
    """The step folder if orbax finalized it with every item export needs, else
    `IncompleteCheckpointError` naming what is missing."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        raise IncompleteCheckpointError(f"checkpoint {step_dir}: no such folder")
    if not step_dir.name.isdigit():
        raise IncompleteCheckpointError(
            f"checkpoint {step_dir}: not a step folder (expected <run>/checkpoints/<step>; "
            "a name like '<step>.orbax-checkpoint-tmp-*' is a save that was interrupted)")
    required = {
        STEP_METADATA_FILE: step_dir / STEP_METADATA_FILE,
        f"{TRAIN_STATE_ITEM}/{PYTREE_METADATA_FILE}":
            step_dir / TRAIN_STATE_ITEM / PYTREE_METADATA_FILE,
        f"{CONFIG_ITEM}/{JSON_ITEM_FILE}": step_dir / CONFIG_ITEM / JSON_ITEM_FILE,
        f"{MANIFEST_ITEM}/{JSON_ITEM_FILE}": step_dir / MANIFEST_ITEM / JSON_ITEM_FILE,
    }
    missing = [name for name, path in required.items() if not path.is_file()]
    if missing:
        raise IncompleteCheckpointError(
            f"checkpoint {step_dir} is incomplete (missing {', '.join(missing)}): the save "
            "was interrupted or files were removed; use another step")
    damage = find_damage(step_dir)
    if damage is not None:
        raise CheckpointCorruptError(f"checkpoint {step_dir} is damaged: {damage}; use another step")
    return step_dir


def refuse_run_folder(out: str | os.PathLike, checkpoint: str | os.PathLike | None = None) -> None:
    """FileExistsError when writing (and with ``--overwrite`` replacing) ``out`` could
    destroy training output: ``out`` contains ``checkpoint``, is a run folder (any of
    `RUN_FOLDER_MARKERS`) or holds an orbax checkpoint anywhere below it."""
    out = Path(out).resolve()
    if checkpoint is not None and Path(checkpoint).resolve().is_relative_to(out):
        raise FileExistsError(f"--out {out} contains the checkpoint being exported; choose a new folder "
                              "(e.g. <run>/hf_<step>)")
    if not out.is_dir():
        return
    markers = [name for name in RUN_FOLDER_MARKERS if (out / name).exists()]
    if markers:
        raise FileExistsError(f"--out {out} is a training run's folder (it holds {', '.join(markers)}); "
                              "export never replaces one, --overwrite or not: choose a new folder")
    for folder, _, files in os.walk(out):
        if STEP_METADATA_FILE in files:
            raise FileExistsError(f"--out {out} holds checkpoints ({folder}); export never replaces "
                                  "them, --overwrite or not: choose a new folder")


def check_finite(arrays: Mapping[str, np.ndarray], source: str) -> None:
    """NonFiniteStateError naming the parameters of `arrays` that hold NaN or ±inf."""
    bad = non_finite_leaves(dict(arrays))
    if bad:
        raise NonFiniteStateError(f"{source}: parameters hold NaN/inf ({', '.join(bad)}); not exported "
                                  "(export an earlier, finite step)")


def read_step_config(step_dir: str | os.PathLike) -> dict[str, Any]:
    """The JSON run config saved with the step (train.py's checkpoint key)."""
    path = Path(step_dir) / CONFIG_ITEM / JSON_ITEM_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise IncompleteCheckpointError(f"checkpoint {step_dir}: cannot read {path}: {error}") from None


def read_step_params(step_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """{dotted parameter name: host array} of ``train_state.params``, restored alone
    (orbax partial restore) as saved: no target, no sharding, no optimizer state."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    from spopp_jax.models.partitioning import path_name

    path = epath.Path(Path(step_dir) / TRAIN_STATE_ITEM)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = handler.metadata(path)
        saved = getattr(metadata, "tree", metadata)
        if PARAMS_KEY not in saved:
            raise IncompleteCheckpointError(
                f"checkpoint {step_dir}: {TRAIN_STATE_ITEM} has no '{PARAMS_KEY}' "
                f"(it has {sorted(saved)})")
        item = {PARAMS_KEY: jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                                          saved[PARAMS_KEY])}
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
        restored = handler.restore(path, args=ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True))
    except IncompleteCheckpointError:
        raise
    except Exception as error:  # orbax/tensorstore raise many types for damaged data
        raise IncompleteCheckpointError(
            f"checkpoint {step_dir}: the parameter arrays cannot be read "
            f"({type(error).__name__}: {_first_line(error)}); "
            "the step is damaged or was written by an incompatible orbax") from None
    leaves = jax.tree_util.tree_flatten_with_path(restored[PARAMS_KEY])[0]
    return {path_name(p): np.asarray(leaf) for p, leaf in leaves}


def _first_line(error: BaseException, limit: int = MESSAGE_CHARS) -> str:
    """The first line of an error, without tensorstore's JSON spec, at most `limit` chars."""
    text = (str(error).splitlines() or [""])[0].split(" [tensorstore_spec=")[0]
    return text if len(text) <= limit else text[:limit] + "..."


# ----------------------------------------------------------------------------- model folder


def _run_root(step_dir: Path) -> Path:
    """<run> of <run>/checkpoints/<step>."""
    return step_dir.resolve().parent.parent


def _candidate_folders(step_dir: Path, saved: Mapping[str, Any]) -> list[Path]:
    model = saved.get("model") or {}
    candidates = [_run_root(step_dir) / WARMSTART_FOLDER]
    for key in ("path", "tiny_dir"):
        if model.get(key):
            folder = Path(model[key])
            candidates.append(folder)
            if not folder.is_absolute():   # relative to where train.py ran: try the run's parent
                candidates.append(_run_root(step_dir).parent / folder)
    return candidates


def resolve_model_folder(step_dir: str | os.PathLike, saved: Mapping[str, Any],
                         model_folder: str | os.PathLike | None = None) -> Path:
    """The HF folder giving architecture and tokenizer: `model_folder` if given, else the
    first of <run>/warmstart_model, model.path, model.tiny_dir that holds a config.json."""
    if model_folder is not None:
        folder = Path(model_folder)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"--model {folder}: no config.json there (expected the HF "
                                    "folder the run started from)")
        return folder
    candidates = _candidate_folders(Path(step_dir), saved)
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder
    raise FileNotFoundError(
        f"checkpoint {step_dir}: cannot find the HF folder the run started from (looked in "
        f"{', '.join(map(str, candidates))}); pass --model <folder with config.json and "
        "the tokenizer>")


def _parameter_differences(arrays: Mapping[str, np.ndarray],
                           expected: Mapping[str, Any]) -> list[str]:
    diffs = []
    for name in sorted(set(arrays) | set(expected)):
        if name not in arrays:
            diffs.append(f"{name}: missing in checkpoint")
        elif name not in expected:
            diffs.append(f"{name}: in checkpoint but not in the model")
        elif tuple(arrays[name].shape) != tuple(expected[name].shape):
            diffs.append(f"{name}: checkpoint shape {tuple(arrays[name].shape)}, model "
                         f"shape {tuple(expected[name].shape)}")
    return diffs


def model_from_params(arrays: Mapping[str, np.ndarray], model_folder: str | os.PathLike,
                      dtype: str | None = None, source: str = "checkpoint"):
    """The `Qwen3ForCausalLM` of `model_folder`'s config.json holding `arrays` (dotted
    names as in `read_step_params`), cast to `dtype` (None: the arrays' own dtype).
    Raises `CheckpointMismatchError` listing every missing / extra / reshaped parameter."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from spopp_jax.models import ModelConfig
    from spopp_jax.models.hf_io import abstract_model
    from spopp_jax.models.partitioning import path_name

    config = ModelConfig.from_hf(str(model_folder))
    if dtype is None:
        dtype = str(next(iter(arrays.values())).dtype) if arrays else "float32"
    graphdef, state = abstract_model(config, dtype)
    expected = {path_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    diffs = _parameter_differences(arrays, expected)
    if diffs:
        shown = diffs if len(diffs) <= 20 else diffs[:20] + [f"... and {len(diffs) - 20} more"]
        raise CheckpointMismatchError(
            f"{source} does not match the model in {model_folder} ({len(diffs)} differences):"
            "\n  " + "\n  ".join(shown))
    filled = jax.tree_util.tree_map_with_path(
        lambda p, leaf: jnp.asarray(arrays[path_name(p)], dtype=leaf.dtype), state)
    return nnx.merge(graphdef, filled)


# ----------------------------------------------------------------------------- writing a folder


def _token_id(tokenizer_json: Path, token: Any) -> int | None:
    if isinstance(token, Mapping):           # {"content": "<|im_end|>", ...}
        token = token.get("content")
    if not token or not tokenizer_json.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).token_to_id(str(token))


def generation_config(tokenizer_folder: str | os.PathLike,
                      sampling: SamplingDefaults) -> dict[str, Any]:
    """generation_config.json contents: special token ids from the tokenizer files,
    sampling as in the rollouts (do_sample, temperature, top_p, top_k, max_new_tokens)."""
    folder = Path(tokenizer_folder)
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        tokenizer_config = {}
    config: dict[str, Any] = {}
    for role in ("bos", "eos", "pad"):
        token_id = _token_id(folder / "tokenizer.json", tokenizer_config.get(f"{role}_token"))
        if token_id is not None:
            config[f"{role}_token_id"] = token_id
    config.update(do_sample=True, temperature=float(sampling.temperature),
                  top_p=float(sampling.top_p),
                  top_k=HF_TOP_K_OFF if sampling.top_k == OUR_TOP_K_OFF else int(sampling.top_k))
    if sampling.max_new_tokens is not None:
        config["max_new_tokens"] = int(sampling.max_new_tokens)
    return config


def _copy_tokenizer(source: Path, target: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
            copied.append(name)
    if "tokenizer.json" not in copied and "tokenizer_config.json" not in copied:
        raise FileNotFoundError(f"{source} holds no tokenizer (tokenizer.json or "
                                "tokenizer_config.json); pass --model <folder with one>")
    return copied


def _apply_umask(folder: Path) -> None:
    """Gives the staged folder and its files the modes a plain mkdir / open would have
    (mkdtemp makes the folder owner-only, safetensors writes its file owner-only). The
    umask is read from a probe file, not os.umask, which would change it for every
    thread of the process while it is read."""
    probe = folder / ".mode-probe"
    probe.touch()
    file_mode = probe.stat().st_mode & 0o777
    probe.unlink()
    masked = 0o666 & ~file_mode                       # the umask's read/write bits
    os.chmod(folder, 0o777 & ~(masked | (masked & 0o444) >> 2))
    for file in folder.iterdir():
        os.chmod(file, file_mode)


def _replace_folder(staging: Path, out: Path) -> None:
    """Moves the finished `staging` folder to `out` (an existing `out` is replaced)."""
    if out.exists():
        old = out.with_name(out.name + ".replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out)


def export_model(model, tokenizer_folder: str | os.PathLike, out: str | os.PathLike,
                 sampling: SamplingDefaults = SamplingDefaults(),
                 max_shard_size: int | str = "5GB") -> Path:
    """Writes `model` + the tokenizer files of `tokenizer_folder` + generation_config.json
    as a HF folder at `out`, atomically (staged beside `out`, renamed when complete).
    train.py calls it with the live policy (end of run, ``export_every``)."""
    from flax import nnx

    from spopp_jax.models import save_pretrained

    bad = non_finite_leaves(nnx.state(model, nnx.Param))
    if bad:
        raise NonFiniteStateError(f"the policy's parameters hold NaN/inf ({', '.join(bad)}); "
                                  f"not exported to {out}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        save_pretrained(model, str(staging), max_shard_size=max_shard_size)
        _copy_tokenizer(Path(tokenizer_folder), staging)
        (staging / GENERATION_CONFIG_FILE).write_text(
            json.dumps(generation_config(tokenizer_folder, sampling), indent=2, sort_keys=True))
        _apply_umask(staging)
        _replace_folder(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def export_checkpoint(step_dir: str | os.PathLike, out: str | os.PathLike,
                      model_folder: str | os.PathLike | None = None,
                      dtype: str | None = None) -> Path:
    """Checkpoint step folder -> HF folder at `out` (see the module docstring)."""
    step_dir = check_step_complete(step_dir)
    saved = read_step_config(step_dir)
    folder = resolve_model_folder(step_dir, saved, model_folder)
    arrays = read_step_params(step_dir)
    check_finite(arrays, f"checkpoint {step_dir}")
    dtype = dtype or (saved.get("model") or {}).get("compute_dtype")  # master weights -> compute dtype
    model = model_from_params(arrays, folder, dtype, source=f"checkpoint {step_dir}")
    return export_model(model, folder, out, SamplingDefaults.from_run_config(saved))


# ----------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spopp_jax.export",
        description="Convert a training checkpoint step into a Hugging Face model folder.")
    parser.add_argument("--checkpoint", required=True,
                        help="a step folder: <run>/checkpoints/<step>")
    parser.add_argument("--out", required=True, help="the HF folder to write")
    parser.add_argument("--model", default=None,
                        help="HF folder the run started from (architecture + tokenizer); "
                             "default: <run>/warmstart_model, else the run's model.path / "
                             "model.tiny_dir")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="parameter dtype of the export (default: the run's model.compute_dtype, "
                             "else as in the checkpoint)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if it already holds files")
    return parser


def _run_export(args: argparse.Namespace) -> Path:
    out = Path(args.out)
    refuse_run_folder(out, args.checkpoint)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise FileExistsError(f"--out {out} already holds files; pass --overwrite to "
                              "replace them")
    return export_checkpoint(args.checkpoint, out, args.model, args.dtype)


def _export_or_message(argv: Sequence[str] | None) -> tuple[int, str]:
    """(exit status, text for the terminal): the written folder, or one 'export error'
    line (a mismatch adds one indented line per differing parameter)."""
    args = _parser().parse_args(argv)
    try:
        written = _run_export(args)
    except (OSError, ValueError, NotImplementedError) as error:
        # IncompleteCheckpointError / FileNotFoundError / FileExistsError / disk full are
        # OSErrors; CheckpointMismatchError, CheckpointCorruptError, NonFiniteStateError
        # and bad configs are ValueErrors.
        return EXIT_USAGE, f"export error: {error}"
    return 0, f"exported {args.checkpoint} -> {written}"


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 0 on success, 2 with an 'export error: ...' message on refused input."""
    status, message = _export_or_message(argv)
    print(message, file=sys.stderr if status else sys.stdout)
    return status


def _cli() -> None:
    """`main` for the command line. A failed orbax read of damaged array data leaves
    tensorstore callbacks running that print 'Event loop is closed' tracebacks from
    other threads, during the restore and after it. File descriptor 2 (and sys.stderr)
    point at a log file for the whole export (named in the error message); on failure our
    message goes to the saved real stderr, fd 2 is left on the log and the process ends
    with os._exit, so a late third-party write can never reach the terminal; on success
    stderr is restored and the captured text passed on unchanged."""
    log = tempfile.NamedTemporaryFile("w+", prefix="spopp-export-", suffix=".log",
                                      delete=False)
    sys.stderr.flush()
    real_fd = os.dup(2)
    os.dup2(log.fileno(), 2)
    real_stderr, sys.stderr = sys.stderr, log
    try:
        status, message = _export_or_message(None)
    except SystemExit as exit_:      # argparse: a usage error or --help
        status, message = (exit_.code if isinstance(exit_.code, int) else EXIT_USAGE), None
    log.flush()
    with open(log.name) as f:
        captured = f.read()
    if status == 0 or message is None:
        os.dup2(real_fd, 2)
        sys.stderr = real_stderr
        log.close()
        os.unlink(log.name)
        sys.stderr.write(captured)
        if message is not None:
            print(message)
        raise SystemExit(status)
    text = message + (f"\n(third-party output: {log.name})" if captured.strip() else "")
    sys.stdout.flush()
    os.write(real_fd, (text + "\n").encode())
    if not captured.strip():
        os.unlink(log.name)
    os._exit(status)


if __name__ == "__main__":
    _cli()
