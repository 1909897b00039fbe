"""verl knob names as command-line aliases: the rewrite gives the same TrainConfig as our
own flags; aliases whose meaning differs are refused with a message naming them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bridge.config import load_config
from rollout_bridge.verl_aliases import ALIASES, AliasError, alias_table, rewrite_verl_aliases


def _spellings(key: str, value: str) -> list[list[str]]:
    short = key.removeprefix("actor_rollout_ref.")
    forms = [[f"--{key}", value], [f"--{key}={value}"], [f"{key}={value}"], [f"+{key}={value}"]]
    if short != key:
        forms.append([f"--{short}", value])
    return forms


TRANSLATED = [
    ("actor_rollout_ref.actor.clip_ratio_low", "0.15", ["--loss.clip_low", "0.15"]),
    ("actor_rollout_ref.actor.clip_ratio_high", "0.3", ["--loss.clip_high", "0.3"]),
    ("actor_rollout_ref.actor.clip_ratio", "0.25",
     ["--loss.clip_low", "0.25", "--loss.clip_high", "0.25"]),
    ("actor_rollout_ref.actor.clip_ratio_c", "3.0", ["--method.dual_clip", "3.0"]),
    ("algorithm.rollout_correction.rollout_is_threshold", "1.5", ["--loss.is_cap", "1.5"]),
    ("actor_rollout_ref.actor.tis_imp_ratio_cap", "4", ["--loss.is_cap", "4"]),
    ("actor_rollout_ref.rollout.temperature", "0.7", ["--rollout.temperature", "0.7"]),
    ("actor_rollout_ref.rollout.top_p", "0.9", ["--rollout.top_p", "0.9"]),
    ("actor_rollout_ref.rollout.top_k", "20", ["--rollout.top_k", "20"]),
    ("actor_rollout_ref.actor.optim.lr", "1e-6", ["--optim.learning_rate", "1e-6"]),
    ("actor_rollout_ref.actor.optim.weight_decay", "0.01", ["--optim.weight_decay", "0.01"]),
    ("actor_rollout_ref.actor.grad_clip", "0.5", ["--optim.max_grad_norm", "0.5"]),
    ("trainer.total_training_steps", "7", ["--steps", "7"]),
    ("trainer.save_freq", "5", ["--checkpoint_every", "5"]),
    ("trainer.default_local_dir", "runs/v", ["--output_dir", "runs/v"]),
    ("actor_rollout_ref.model.path", "/models/q", ["--model.path", "/models/q"]),
]


@pytest.mark.parametrize("key, value, ours", TRANSLATED, ids=[t[0] for t in TRANSLATED])
def test_alias_spellings_become_our_flags(key, value, ours):
    for form in _spellings(key, value):
        assert rewrite_verl_aliases(["--seed", "1", *form, "--resume"]) == \
            ["--seed", "1", *ours, "--resume"], form


@pytest.mark.parametrize("key, value, ours", TRANSLATED, ids=[t[0] for t in TRANSLATED])
def test_alias_and_our_flag_give_the_same_config(key, value, ours):
    assert load_config(rewrite_verl_aliases([f"{key}={value}"])) == load_config(ours)


def test_every_alias_is_tested_or_refused():
    translated = {t[0] for t in TRANSLATED}
    for alias in ALIASES:
        assert (alias.verl in translated) == bool(alias.ours), alias.verl


def test_prompt_counted_batch_sizes():
    argv = ["data.train_batch_size=16", "actor_rollout_ref.rollout.n=4",
            "--actor.ppo_mini_batch_size", "4", "--method", "grpo"]
    rewritten = rewrite_verl_aliases(argv)
    assert rewritten == ["--method.group_size", "4", "--rollout.batch_size", "64",
                         "--optim.num_mini_batches", "4", "--method", "grpo"]
    config = load_config(rewritten)
    assert (config.rollout.batch_size, config.method.group_size,
            config.optim.num_mini_batches) == (64, 4, 4)
    assert rewrite_verl_aliases(["data.train_batch_size=32"]) == ["--rollout.batch_size", "32"]


@pytest.mark.parametrize("argv, fragment", [
    (["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"], "token mean"),
    (["--actor.ppo_epochs", "2"], "one pass"),
    (["--actor.ppo_micro_batch_size_per_gpu", "4"], "--optim.num_micro_batches"),
    (["data.max_response_length=512"], "--rollout.max_new_tokens"),
    (["data.max_prompt_length=512"], "--rollout.max_total_tokens"),
    (["algorithm.rollout_correction.rollout_is=sequence"], "per token"),
    (["algorithm.rollout_correction.rollout_is_threshold=-1"], "always truncated"),
    (["--actor.clip_ratio_c", "-3"], "> 0"),
    (["--actor.ppo_mini_batch_size", "4"], "data.train_batch_size"),
    (["data.train_batch_size=10", "--actor.ppo_mini_batch_size", "4"], "does not divide"),
    (["data.train_batch_size=ten"], "integer"),
    (["--actor.clip_ratio_low"], "needs a value"),
    (["--actor.clip_ratio_low", "--seed", "1"], "needs a value"),
    (["--actor.clip_ratio_low", "0.1", "--loss.clip_low", "0.2"], "give it once"),
    (["--actor.clip_ratio", "0.1", "--actor.clip_ratio_high", "0.2"], "give it once"),
    (["--actor.clip_ratio_low", "0.1", "actor_rollout_ref.actor.clip_ratio_low=0.2"],
     "same verl key"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_refused_aliases_name_the_key(argv, fragment):
    with pytest.raises(AliasError) as info:
        rewrite_verl_aliases(argv)
    message = str(info.value)
    assert fragment in message
    alias_token = next(a for a in argv if "." in a and not a.startswith("--loss"))
    assert alias_token.split("=")[0].lstrip("+") in message


@pytest.mark.parametrize("argv", [
    ["actor_rollout_ref.actor.loss_agg_mode=token-mean"],
    ["--actor.ppo_epochs", "1"],
    ["algorithm.rollout_correction.rollout_is=token"],
])
def test_our_fixed_behaviour_is_accepted_and_dropped(argv):
    assert rewrite_verl_aliases(["--seed", "2", *argv]) == ["--seed", "2"]


OUR_TOKENS = st.sampled_from(["--seed", "3", "--resume", "--config_path", "c.yaml",
                              "--loss.clip_low=0.1", "--rollout.batch_size", "8",
                              "--output_dir", "runs/a=b", "key=value", "--optim.lr"])


@settings(max_examples=200, deadline=None)
@given(st.lists(OUR_TOKENS, max_size=12))
def test_arguments_without_aliases_pass_through_unchanged(argv):
    assert rewrite_verl_aliases(argv) == argv


def test_alias_table_covers_every_alias():
    rows = dict(alias_table())
    assert {a.verl for a in ALIASES} <= set(rows)
    assert "refused" in rows["actor_rollout_ref.actor.loss_agg_mode"]


def test_conventions_doc_lists_every_alias():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "CONVENTIONS.md").read_text()
    for verl_key, _ in alias_table():
        assert f"`{verl_key}" in doc, verl_key
