"""Make or reuse a tiny random Qwen3 model + tokenizer in a local HF folder (no downloads).

The folder has exactly what a user's local HF model folder has (config.json,
model.safetensors, tokenizer files with a ChatML chat template), so the rest of the job
loads either one the same way: `spopp_jax.models.from_pretrained(folder)` and
`transformers.AutoTokenizer.from_pretrained(folder)`.

The tokenizer is a byte-level BPE (`rollout_bridge.tokenizer.build_tiny_tokenizer`) trained
on the task texts, so observations are a few hundred tokens rather than a few thousand
bytes. `tiny_model.json` records the shape and the corpus hash; a folder whose record
matches is reused, anything else is rebuilt. Jobs that share one folder (the arms of a
campaign started together) build it once: the others wait for the builder and reuse it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

MARKER = "tiny_model.json"


@dataclasses.dataclass(frozen=True)
class TinyModelShape:
    vocab_size: int = 768
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    seed: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name != "seed" and getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")


def _corpus_hash(texts: list[str]) -> str:
    digest = hashlib.sha1()
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _marker_ok(folder: Path, record: dict) -> bool:
    try:
        with open(folder / MARKER) as f:
            return json.load(f) == record
    except (OSError, json.JSONDecodeError):
        return False


def ensure_tiny_model(folder: str | os.PathLike, corpus: Iterable[str],
                      shape: TinyModelShape = TinyModelShape()) -> Path:
    """Return `folder` holding a tiny model + tokenizer built for `corpus` and `shape`.

    A folder whose marker matches is returned as it is. Otherwise the build (tokenizer,
    weights, then the marker, written atomically and last) runs under an flock on the
    folder, and the marker is checked again once the lock is held: of two jobs building one
    folder at once, the second waits for the first and reuses its folder, so neither ever
    reads a file the other is rewriting. A build that was killed leaves no marker: the next
    call builds again."""
    from spopp_jax.models import ModelConfig, init_model, save_pretrained

    from rollout_bridge.atomic_files import write_json_atomic
    from rollout_bridge.run_lock import folder_flock
    from rollout_bridge.tokenizer import build_tiny_tokenizer

    folder = Path(folder)
    texts = [str(t) for t in corpus]
    if not texts:
        raise ValueError("corpus is empty: the tokenizer needs the task texts")
    record = {"shape": dataclasses.asdict(shape), "corpus_sha1": _corpus_hash(texts)}
    if _marker_ok(folder, record) and (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with folder_flock(folder):   # one builder at a time
        if _marker_ok(folder, record) and (folder / "config.json").exists():
            return folder   # built by another job while this one waited for the lock
        (folder / MARKER).unlink(missing_ok=True)
        tokenizer = build_tiny_tokenizer(texts, folder, vocab_size=shape.vocab_size)
        config = ModelConfig(
            vocab_size=len(tokenizer),
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_heads,
            num_key_value_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            tie_word_embeddings=True,
        )
        model = init_model(config, seed=shape.seed)
        save_pretrained(model, str(folder))
        write_json_atomic(folder / MARKER, record)   # written last: a half-built folder is never reused
    return folder


def check_model_folder(path: str | os.PathLike, field: str = "model.path") -> Path:
    """A user's local HF model folder must exist and hold config.json + a tokenizer."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{field}={str(path)!r} does not exist. Nothing is downloaded by this job: put a "
            "Hugging Face model folder there (config.json, *.safetensors, tokenizer files), "
            "e.g. `huggingface-cli download Qwen/Qwen3.5-0.8B --local-dir <path>` on a "
            "machine with internet access")
    missing = [name for name in ("config.json",) if not (folder / name).exists()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not ((folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()):
        missing.append("tokenizer.json")
    if missing:
        raise FileNotFoundError(f"{field}={str(path)!r} lacks {', '.join(missing)}")
    return folder
