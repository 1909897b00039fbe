"""A tiny byte-level BPE tokenizer with a Qwen-style ChatML chat template.

Built locally with the ``tokenizers`` library (no downloads) so tests and the tiny-model
runs have a real ``transformers`` tokenizer. Byte-level pre-tokenization means the base
alphabet is all 256 bytes: any text a model types round-trips through encode/decode.
"""

from __future__ import annotations

import os
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen-style ChatML: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then
# "<|im_start|>assistant\n" when a generation prompt is asked for.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tiny_tokenizer(
    texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int = 512
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and save it to ``out_dir``.

    The vocabulary is the 256 byte symbols, the special tokens ``<|endoftext|>`` (pad),
    ``<|im_start|>``, ``<|im_end|>`` (eos) and up to ``vocab_size`` in total with merges.
    ``AutoTokenizer.from_pretrained(out_dir)`` reloads it with the ChatML template.
    """
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (bytes + special tokens), got {vocab_size}")
    texts = list(texts)
    if not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be strings")

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=[IM_START],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def load_tokenizer(folder: str | os.PathLike):
    """``AutoTokenizer.from_pretrained(folder)`` of a local folder (nothing is downloaded);
    a missing or corrupt tokenizer file raises ValueError naming the folder instead of a
    library traceback."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # noqa: BLE001 - transformers/tokenizers raise many types
        raise ValueError(
            f"tokenizer in {str(folder)!r} could not be loaded ({type(error).__name__}: {error})"
        ) from error
