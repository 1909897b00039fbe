"""The tiny byte-level BPE tokenizer: special tokens, ChatML template, reload, round trip."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from rollout_bridge.tokenizer import build_tiny_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "say: apple river stone"] * 20


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(CORPUS, out, vocab_size=320)
    return out


@pytest.fixture(scope="module")
def reloaded(tiny_dir):
    return AutoTokenizer.from_pretrained(str(tiny_dir))


def _ids(encoded):
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


def test_special_tokens_are_single_ids(reloaded):
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        ids = reloaded.encode(token, add_special_tokens=False)
        assert len(ids) == 1
        assert reloaded.convert_ids_to_tokens(ids[0]) == token
    assert reloaded.eos_token == "<|im_end|>"
    assert reloaded.pad_token == "<|endoftext|>"
    assert len(reloaded) <= 320


def test_chat_template_renders_chatml_and_tokenizes(reloaded):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say: apple"}]
    text = reloaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nsay: apple<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected
    ids = _ids(reloaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert ids == reloaded.encode(expected, add_special_tokens=False)
    assert ids.count(reloaded.convert_tokens_to_ids("<|im_start|>")) == 3
    no_prompt = reloaded.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == expected[: -len("<|im_start|>assistant\n")]


def test_reload_gives_identical_encodings(tiny_dir, reloaded):
    fresh = build_tiny_tokenizer(CORPUS, tiny_dir / "again", vocab_size=320)
    sample = "the lazy fox says: river! 42"
    assert fresh.encode(sample) == reloaded.encode(sample)
    assert fresh.get_vocab() == reloaded.get_vocab()


def test_vocab_size_too_small_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_tokenizer(CORPUS, tmp_path, vocab_size=100)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=40))
def test_any_text_round_trips(reloaded, text):
    # Byte-level alphabet: unseen characters (emoji, CJK, control chars) still encode.
    ids = reloaded.encode(text, add_special_tokens=False)
    assert reloaded.decode(ids) == text
    assert all(0 <= i < len(reloaded) for i in ids)
