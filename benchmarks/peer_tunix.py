"""Learner train step: our jitted SPO++ `train_step` against Tunix's GRPO policy-loss train
step (google-tunix, its own venv), same tiny Qwen3 weights, same [batch, seq] batch.

    scripts/setup_tunix_cpu.sh                       # once: creates .venv-tunix
    python benchmarks/peer_tunix.py                  # from the main venv (model M, 16 x 256)
    python benchmarks/peer_tunix.py --rounds 3 --micro-batches 1 --tunix-accum 1

Run it with the MAIN venv's python. It is a driver: it writes a random transformers Qwen3
(`save_pretrained`, safetensors) and one batch to a temp folder, then starts two worker
processes of this same file, ``--worker ours`` (main venv) and ``--worker tunix``
(``--tunix-python``, default ``.venv-tunix/bin/python``), which load the same files. The
driver sends "time one step of method X" to the workers in interleaved rounds (ours,
tunix, ours, ...); the worker that is not timing blocks on its stdin, so at most one of
them computes at a time, and load from other users of the machine hits both alike. The
median per method is reported; tokens/s counts every position of the [batch, seq] batch.

What each side computes (one step = loss, gradient, global-norm clip 1.0, AdamW lr 1e-6,
b1 0.9, b2 0.999, eps 1e-8, weight decay 0.1, parameters updated):
  * ours: `learner.make_train_step` (SPEC 5): one forward over the whole [B, T] row, r =
    exp(logp - stop_gradient(logp)), asymmetric clip [0.8, 1.28], dual clip 2, IS weight
    w = min(exp(old - rollout_logp), 2) computed inside the step from the same forward,
    loss = sum over action tokens of w * (-s) / action tokens of the batch.
    ``M=m``: `num_micro_batches` = m (lax.scan gradient accumulation inside one jit).
  * tunix: Tunix's registered ``"grpo"`` policy loss (`tunix.rl.algo_core.grpo_loss_fn`),
    wired into `tunix.rl.trainer.Trainer` exactly as Tunix's agentic GRPO learner does
    (`with_loss_fn(..., has_aux=True)`, `with_gen_model_input_fn`), stepped through the
    trainer's own jitted `_train_step` (`jit_train_and_eval_step(cache_nnx_graph=True)`, as
    `Trainer.train` calls it). Config = `tunix.rl.agentic.agentic_grpo_learner.GRPOConfig`
    with beta 0 (no KL, so no reference forward), epsilon 0.2, epsilon_high 0.28,
    loss_agg_mode "token-mean", num_iterations 1 (old log-probs = stop_gradient of the
    current ones, as ours), sampler_is_threshold 2.0, plus ``epsilon_c = 2.0`` (dual clip;
    read by the loss with getattr, not a config field). The prompt (first quarter of each
    row) and completion (the rest) are passed separately as Tunix expects; the loss mask
    is our action mask restricted to the completion. Tunix's loss additionally computes
    the token entropy of the [B, completion, V] logits and ~15 diagnostic scalars (aux).
    ``tunix step``: the IS weights are passed precomputed (Tunix's agentic learner computes
    them OUTSIDE the step from a separate trainer forward, `get_actor_per_token_logps`).
    ``tunix fwd+step``: that extra no-grad forward (`common.compute_per_token_logps`, the
    function the RL cluster calls), the weights, then the step: what Tunix's agentic GRPO
    learner runs per update with ``sampler_is="token"``; the comparable cost to ours.
    ``accum=a``: `TrainingConfig(gradient_accumulation_steps=a)` (optax.MultiSteps): a
    calls of the step on B/a rows each = one update. MultiSteps averages the a
    micro-batch token-means, not one global token-mean (weights rows slightly differently).

Checks printed before timing (same weights, same loss): per-token log-probs of the batch's
action tokens from transformers (torch), ours and Tunix at the initial weights (max abs
differences), and the first step's loss and pre-clip gradient norm of ours (M=1) and
Tunix (step, accum=1), which must agree (for accum > 1 Tunix reports the last micro-batch's
loss and gradient norm, so those are not comparable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAD_ID = 0  # Tunix derives its attention mask from token != pad_id: real tokens avoid 0.
REPLY = "PEER_REPLY "


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 16],
                        help="our num_micro_batches values to time")
    parser.add_argument("--tunix-accum", type=int, nargs="+", default=[1, 16],
                        help="Tunix gradient_accumulation_steps values to time")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per method")
    parser.add_argument("--tunix-python", default=os.path.join(REPO, ".venv-tunix", "bin", "python"))
    parser.add_argument("--worker", choices=["ours", "tunix"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- shared inputs


def make_batch(batch: int, seq: int, vocab: int, seed: int = 0):
    """The learner_step.py batch layout: prompt = first quarter of each row, then action
    tokens with one 8-token observation span in the middle; 10% of rows end at seq/2 (right
    padding). Token ids are drawn from [1, vocab) and padding positions hold PAD_ID, so a
    pad-id-derived mask (Tunix) equals the explicit attention mask (ours)."""
    rng = np.random.default_rng(seed)
    pos = np.arange(seq)[None, :]
    lengths = np.where(rng.random(batch) < 0.1, seq // 2, seq)[:, None]
    attention = pos < lengths
    ids = np.where(attention, rng.integers(1, vocab, size=(batch, seq)), PAD_ID).astype(np.int32)
    action = attention & (pos >= seq // 4) & ~((pos >= seq // 2) & (pos < seq // 2 + 8))
    rollout = np.where(action, rng.normal(-6.2, 0.3, size=(batch, seq)), 0.0).astype(np.float32)
    advantages = np.repeat(rng.normal(size=(batch, 1)), seq, axis=1).astype(np.float32)
    return {"input_ids": ids, "attention_mask": attention, "action_mask": action,
                "rollout_logp": rollout, "advantages": advantages}


def load_batch(folder: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(folder, "batch.npz")) as data:
        return {k: data[k] for k in data.files}


def block(tree):
    import jax
    return jax.block_until_ready(tree)


# ----------------------------------------------------------------------------- ours


def ours_methods(args, folder: str):
    """{name: zero-arg step}, info, and initial log-probs [B, T] of our learner."""
    import jax
    import jax.numpy as jnp

    from spopp_jax import learner
    from spopp_jax.models import from_pretrained

    model = from_pretrained(folder, dtype="float32")
    batch = learner.TrainBatch(**{k: jnp.asarray(v) for k, v in load_batch(folder).items()})
    methods, first = {}, {}
    for m in args.micro_batches:
        config = learner.LearnerConfig(learning_rate=1e-6, num_mini_batches=1, action_logits_fraction=None,
                                       num_micro_batches=m)
        model_def, state = learner.init_train_state(model, config)
        holder = {"state": state}
        step = learner.make_train_step(model_def, config)

        def run(holder=holder, step=step):
            holder["state"], metrics = step(holder["state"], batch)
            return block(metrics)

        start = time.perf_counter()
        metrics = run()
        first[f"ours M={m}"] = {"compile_s": time.perf_counter() - start,
                                    "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}
        methods[f"ours M={m}"] = run
    model_def, params = learner.split_model(model)
    logits = jax.jit(model_def.apply)(params, batch.input_ids, batch.attention_mask)
    logp = np.asarray(learner.token_logprobs(logits, batch.input_ids))
    info = {"versions": f"jax {jax.__version__}", "first": first}
    return methods, info, logp


# ----------------------------------------------------------------------------- tunix


def tunix_model_config(hf_config: dict):
    from tunix.models.qwen3 import model as qwen3

    return qwen3.ModelConfig(
        num_layers=hf_config["num_hidden_layers"], vocab_size=hf_config["vocab_size"],
        embed_dim=hf_config["hidden_size"], hidden_dim=hf_config["intermediate_size"],
        num_heads=hf_config["num_attention_heads"], head_dim=hf_config["head_dim"],
        num_kv_heads=hf_config["num_key_value_heads"],
        rope_theta=int(_rope_theta(hf_config)), norm_eps=hf_config["rms_norm_eps"],
        use_tied_embedding=hf_config.get("tie_word_embeddings", False),
    )


def _rope_theta(hf_config: dict) -> float:
    return (hf_config.get("rope_parameters") or {}).get("rope_theta", hf_config.get("rope_theta"))


def tunix_algo_config():
    """Tunix agentic GRPO config set to SPEC 5: no KL, clip [0.8, 1.28], dual clip 2,
    token-mean over the batch, IS cap 2, one iteration (old = current, no extra forward)."""
    from tunix.rl.agentic import agentic_grpo_learner

    config = agentic_grpo_learner.GRPOConfig(
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_agg_mode="token-mean",
        num_iterations=1, sampler_is="token", sampler_is_threshold=2.0,
    )
    config.epsilon_c = 2.0  # dual clip: read by grpo_loss_fn via getattr, not a field
    config.temperature = 1.0  # set from the rollout config by the learner
    return config


def tunix_examples(batch: dict, is_weights: np.ndarray | None, rows: slice):
    """Tunix TrainExample of `rows`: prompt = first quarter, completion = the rest."""
    import jax.numpy as jnp
    from tunix.rl import common

    prompt_len = batch["input_ids"].shape[1] // 4
    ids = batch["input_ids"][rows]
    return common.TrainExample(
        prompt_ids=jnp.asarray(ids[:, :prompt_len]),
        prompt_mask=jnp.asarray(ids[:, :prompt_len] != PAD_ID),
        completion_ids=jnp.asarray(ids[:, prompt_len:]),
        completion_mask=jnp.asarray(batch["action_mask"][rows, prompt_len:].astype(np.int32)),
        advantages=jnp.asarray(batch["advantages"][rows, 0]),
        ref_per_token_logps=None,
        old_per_token_logps=None,
        sampler_is_weights=None if is_weights is None else jnp.asarray(is_weights[rows]),
    )


def tunix_is_weights(logp, rollout, mask, threshold: float):
    """The agentic learner's token IS weight: min(exp(clip(trainer - sampler, +-20)), cap) * mask."""
    import jax
    import jax.numpy as jnp

    log_ratio = jnp.clip(logp - rollout, -20.0, 20.0)
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_ratio), threshold) * mask)


def tunix_methods(args, folder: str):
    """{name: zero-arg step}, info, and initial log-probs [B, T] (0 outside the completion)."""
    import importlib.metadata as md

    import flax
    import jax
    import optax
    from flax import nnx
    from tunix.models.qwen3 import params as qwen3_params
    from tunix.rl import algo_core, common
    from tunix.rl import trainer as rl_trainer
    from tunix.sft import peft_trainer

    with open(os.path.join(folder, "config.json")) as f:
        hf_config = json.load(f)
    model_config = tunix_model_config(hf_config)
    batch = load_batch(folder)
    prompt_len = args.seq // 4
    algo = tunix_algo_config()
    completion_mask = batch["action_mask"][:, prompt_len:].astype(np.float32)
    rollout = batch["rollout_logp"][:, prompt_len:]
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(1e-6, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1),
    )

    def loss_fn(model, train_example, algo_config):
        return algo_core.grpo_loss_fn(model, train_example, algo_config=algo, pad_id=PAD_ID, eos_id=PAD_ID)

    def old_logps(model, example):
        graphdef, state = nnx.split(model)
        return common.compute_per_token_logps(
            graphdef, state, prompt_tokens=example.prompt_ids, completion_tokens=example.completion_ids,
            pad_id=PAD_ID, eos_id=PAD_ID, stop_gradient=True, return_logits=False, temperature=1.0)

    full = tunix_examples(batch, None, slice(None))
    methods, first, logp0 = {}, {}, None
    for accum in args.tunix_accum:
        model = qwen3_params.create_model_from_safe_tensors(folder, model_config, dtype=jax.numpy.float32)
        trainer = rl_trainer.Trainer(
            model, optimizer,
            peft_trainer.TrainingConfig(eval_every_n_steps=1 << 30,
                                        gradient_accumulation_steps=None if accum == 1 else accum),
            custom_checkpoint_metadata_fn=dict,
        )
        trainer.with_loss_fn(loss_fn, has_aux=True)
        trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
        train_step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
        logp = np.asarray(old_logps(model, full))
        if logp0 is None:
            logp0 = logp
        weights = np.asarray(tunix_is_weights(logp, rollout, completion_mask, algo.sampler_is_threshold))
        rows = args.batch // accum
        parts = [slice(i * rows, (i + 1) * rows) for i in range(accum)]
        examples = [tunix_examples(batch, weights, part) for part in parts]
        rollouts = [jax.numpy.asarray(rollout[part]) for part in parts]

        def step(examples=examples, train_step=train_step):
            out = [train_step(example) for example in examples]
            return block(out[-1])

        def fwd_step(examples=examples, rollouts=rollouts, train_step=train_step, model=model):
            out = []
            for example, rollout_part in zip(examples, rollouts):
                # as the agentic learner: trainer forward, IS weights, then the step
                old = old_logps(model, example)
                w = tunix_is_weights(old, rollout_part, example.completion_mask, algo.sampler_is_threshold)
                out.append(train_step(example.replace(sampler_is_weights=w)))
            return block(out[-1])

        start = time.perf_counter()
        loss, aux, grad_norm = step()
        # with accum > 1 these are the last micro-batch's loss and gradient norm
        first[f"tunix step accum={accum}"] = {
            "compile_s": time.perf_counter() - start, "loss": float(loss), "grad_norm": float(grad_norm),
            "entropy": float(aux["entropy"]), "is_weight_mean": float(aux["sampler_is/weight_mean"])}
        fwd_step()  # compiles the forward
        methods[f"tunix step accum={accum}"] = step
        methods[f"tunix fwd+step accum={accum}"] = fwd_step
    info = {"versions": f"jax {jax.__version__}, flax {flax.__version__}, google-tunix "
                         f"{md.version('google-tunix')}, optax {optax.__version__}, "
                         f"safetensors {md.version('safetensors')}", "first": first}
    full_logp = np.zeros(batch["input_ids"].shape, np.float32)
    full_logp[:, prompt_len:] = logp0
    return methods, info, full_logp


# ----------------------------------------------------------------------------- worker


def worker_main(args) -> None:
    """Builds the methods, answers "info", then "time NAME" (one timed call) until EOF."""
    build = ours_methods if args.worker == "ours" else tunix_methods
    methods, info, logp = build(args, args.dir)
    np.save(os.path.join(args.dir, f"logp_{args.worker}.npy"), logp)
    print(REPLY + json.dumps({**info, "methods": list(methods)}), flush=True)
    for line in sys.stdin:
        command, _, name = line.strip().partition(" ")
        if command != "time":
            break
        start = time.perf_counter()
        methods[name]()
        print(REPLY + json.dumps({"seconds": time.perf_counter() - start}), flush=True)


class Worker:
    """A worker subprocess; `ask` sends one line and returns its JSON reply."""

    def __init__(self, python: str, role: str, args, folder: str):
        self.role = role
        self.log = open(os.path.join(folder, f"{role}.stderr"), "w+")  # noqa: SIM115 (closed in close())
        argv = [python, os.path.abspath(__file__), "--worker", role, "--dir", folder,
                "--micro-batches", *map(str, args.micro_batches),
                "--tunix-accum", *map(str, args.tunix_accum), "--batch", str(args.batch),
                "--seq", str(args.seq)]
        env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, cwd=REPO)

    def reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        self.log.seek(0)
        raise RuntimeError(f"{self.role} worker exited (rc={self.proc.wait()}):\n{self.log.read()[-3000:]}")

    def ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.log.close()


# ----------------------------------------------------------------------------- driver


def save_model_and_batch(args, folder: str):
    """Random transformers Qwen3 (save_pretrained, safetensors) + batch.npz; returns the
    torch model and the batch."""
    from spopp_jax.models.testing import random_hf_model, tiny_hf_config

    hf_config = tiny_hf_config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        intermediate_size=args.ffn, tie_word_embeddings=False,
        max_position_embeddings=max(4096, args.seq), rope_theta=1e6,
    )
    hf_model = random_hf_model(hf_config, seed=0).eval()
    hf_model.save_pretrained(folder)
    batch = make_batch(args.batch, args.seq, args.vocab)
    np.savez(os.path.join(folder, "batch.npz"), **batch)
    return hf_model, batch


def torch_logprobs(hf_model, batch) -> np.ndarray:
    """transformers' log p(x_t | x_<t) for t >= 1 (0 at t = 0), float32."""
    import torch

    ids = torch.as_tensor(batch["input_ids"], dtype=torch.long)
    with torch.no_grad():
        logits = hf_model(input_ids=ids, attention_mask=torch.as_tensor(batch["attention_mask"])).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return np.concatenate([np.zeros((ids.shape[0], 1), np.float32), logp.numpy()], axis=1)


def driver_main(args) -> None:
    from _hardware import cpu_model

    if not os.path.exists(args.tunix_python):
        sys.exit(f"no Tunix venv at {args.tunix_python}: run scripts/setup_tunix_cpu.sh first")
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        hf_model, batch = save_model_and_batch(args, folder)
        reference = torch_logprobs(hf_model, batch)
        load = os.getloadavg()
        workers = {}
        try:
            infos = {}
            for role, python in (("ours", sys.executable), ("tunix", args.tunix_python)):
                workers[role] = Worker(python, role, args, folder)
                infos[role] = workers[role].reply()  # sequential: one heavy process at a time
            report_setup(args, batch, infos, folder, reference, load, cpu_model())
            medians = timed_rounds(workers, infos, args.rounds)
        finally:
            for w in workers.values():
                w.close()
    report_times(args, medians)
    load = os.getloadavg()
    print(f"load avg at end {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; "
          f"wall time {time.perf_counter() - wall:.0f} s")


def report_setup(args, batch, infos, folder, reference, load, cpu) -> None:
    import torch
    import transformers

    mask = batch["action_mask"]
    print(f"hardware: {cpu}, {os.cpu_count()} cpus, load avg {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} "
          f"at start (shared machine)")
    print(f"ours: {infos['ours']['versions']}; tunix venv: {infos['tunix']['versions']}; "
          f"reference: torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"model: Qwen3 vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads}/{args.kv_heads} heads x {args.head_dim}, ffn {args.ffn}, untied, fp32, "
          f"random weights seed 0 (transformers save_pretrained -> safetensors, loaded by "
          f"spopp_jax.models.from_pretrained and tunix.models.qwen3.params."
          f"create_model_from_safe_tensors)")
    print(f"batch: {args.batch} x {args.seq} = {args.batch * args.seq} tokens (prompt {args.seq // 4}), "
          f"{int(mask.sum())} action tokens, batch seed 0")
    logps = {role: np.load(os.path.join(folder, f"logp_{role}.npy")) for role in ("ours", "tunix")}
    for a, b in (("ours", "transformers"), ("tunix", "transformers"), ("tunix", "ours")):
        x = logps[a]
        y = reference if b == "transformers" else logps[b]
        print(f"initial log-probs on action tokens, max |{a} - {b}|: {np.abs(x - y)[mask].max():.2e}")
    for role in ("ours", "tunix"):
        for name, first in infos[role]["first"].items():
            extras = ", ".join(f"{k} {v:.6g}" for k, v in first.items() if k != "compile_s")
            print(f"first step {name:22s}: compile + step {first['compile_s']:5.1f} s, {extras}")
    ours, tunix = infos["ours"]["first"].get("ours M=1"), infos["tunix"]["first"].get("tunix step accum=1")
    if ours and tunix:
        print(f"first step, ours M=1 vs tunix accum=1: |loss diff| {abs(ours['loss'] - tunix['loss']):.2e}, "
              f"grad norm rel. diff {abs(ours['grad_norm'] / tunix['grad_norm'] - 1):.2e}")


def timed_rounds(workers, infos, rounds: int) -> dict[str, float]:
    """Median seconds per method, methods interleaved across both workers each round."""
    names = [(role, name) for role in ("ours", "tunix") for name in infos[role]["methods"]]
    for role, name in names:  # one untimed call each after the compile
        workers[role].ask(f"time {name}")
    times = {name: [] for _, name in names}
    for _ in range(rounds):
        for role, name in names:
            times[name].append(workers[role].ask(f"time {name}")["seconds"])
    return {name: statistics.median(ts) for name, ts in times.items()}


def report_times(args, medians: dict[str, float]) -> None:
    tokens = args.batch * args.seq
    print(f"median of {args.rounds} interleaved rounds:")
    for name, seconds in medians.items():
        print(f"  {name:26s} {seconds * 1e3:9.1f} ms  {tokens / seconds:8.0f} tok/s")
    print("tokens/s ratio ours / tunix (> 1: ours faster):")
    for ours, ours_s in medians.items():
        if ours.startswith("ours"):
            for name, seconds in medians.items():
                if name.startswith("tunix"):
                    print(f"  {ours:10s} / {name:26s} {seconds / ours_s:5.2f}")


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.worker:
        worker_main(ARGS)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        driver_main(ARGS)
