"""Learner idle time on publish: blocking export vs ``BackgroundPublisher``.

Each update is one jitted SPO++ ``train_step`` (donating its state) followed by a publish
of the new params as an HF folder (``save_pretrained``, the filesystem publish of the
vLLM engines). Two systems, interleaved per round:

  blocking:   step; export in the learner thread            (the learner waits for it)
  background: step; BackgroundPublisher.submit (snapshot)   (export on a thread)

Printed per system: median wall time per update, learner idle on publish per update
(blocking: the whole export; background: ``submit``'s wait + snapshot dispatch) and its
share of the update time; the memory cost (bytes of one snapshot = one parameter copy,
and the growth of live JAX array bytes while a publish is pending). The machine's CPU
and the 1-minute load average are printed with every round: on a busy shared machine
the figures are noisy, say so next to them.

    python benchmarks/publish_overlap.py [--rounds 3 --updates 4 --hidden 256 --layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _hardware import cpu_model  # noqa: E402

from rollout_bridge.background_publish import BackgroundPublisher, PublisherConfig, tree_nbytes  # noqa: E402
from spopp_jax import learner  # noqa: E402
from spopp_jax.models import ModelConfig, init_model  # noqa: E402
from spopp_jax.models.hf_io import save_pretrained  # noqa: E402

SYSTEMS = ("blocking", "background")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=4, help="updates per system per round")
    return parser.parse_args()


def build(args):
    config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=args.hidden // 8)
    model = init_model(config, seed=0)
    learner_config = learner.LearnerConfig(num_micro_batches=1, length_bucket=None, num_mini_batches=1, action_logits_fraction=None,
                                           learning_rate=1e-4)
    model_def, state = learner.init_train_state(model, learner_config)
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq)
    action_mask = np.arange(args.seq)[None, :] >= args.seq // 4
    batch = learner.TrainBatch(
        input_ids=jnp.asarray(rng.integers(0, args.vocab, size=shape), jnp.int32),
        attention_mask=jnp.ones(shape, bool),
        action_mask=jnp.asarray(np.broadcast_to(action_mask, shape)),
        rollout_logp=jnp.asarray(np.where(action_mask, -6.0, 0.0) * np.ones(shape), jnp.float32),
        advantages=jnp.asarray(rng.normal(size=shape), jnp.float32),
    )
    return model_def, state, batch, learner.make_train_step(model_def, learner_config)


def exporter(model_def, root):
    def export(params, policy_event):
        save_pretrained(model_def.merge(params), os.path.join(root, f"policy_{policy_event:06d}"))

    return export


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def run_system(system, state, batch, step, export, publisher, updates, first_event):
    """``updates`` step+publish rounds; returns (state, [update s], [idle s], [live growth])."""
    update_s, idle_s, growth = [], [], []
    for i in range(updates):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        before = live_bytes()
        if system == "blocking":
            t = time.perf_counter()
            export(state.params, first_event + i)
            idle_s.append(time.perf_counter() - t)
        else:
            idle_s.append(publisher.submit(state.params, first_event + i))
            growth.append(live_bytes() - before)
        update_s.append(time.perf_counter() - start)
    if publisher is not None:
        publisher.wait()  # outside the timed updates: the next round starts clean
    return state, update_s, idle_s, growth


def main(args):
    model_def, state, batch, step = build(args)
    print(f"cpu: {cpu_model()}, {os.cpu_count()} cores; jax {jax.__version__} {jax.default_backend()}")
    params_bytes = tree_nbytes(state.params)
    with tempfile.TemporaryDirectory() as root:
        export = exporter(model_def, root)
        publisher = BackgroundPublisher(export, PublisherConfig(snapshot="device", max_pending=1))
        state, *_ = run_system("blocking", state, batch, step, export, None, 1, 0)  # compile + warm
        state, *_ = run_system("background", state, batch, step, export, publisher, 1, 1)
        results = {s: {"update": [], "idle": [], "growth": []} for s in SYSTEMS}
        event = 2
        for round_index in range(args.rounds):
            print(f"round {round_index}: load average (1 min) {os.getloadavg()[0]:.2f}")
            for system in SYSTEMS:
                state, update_s, idle_s, growth = run_system(
                    system, state, batch, step, export, publisher if system == "background" else None,
                    args.updates, event)
                event += args.updates
                results[system]["update"] += update_s
                results[system]["idle"] += idle_s
                results[system]["growth"] += growth
        publisher.close()
    print(f"params: {params_bytes / 2**20:.1f} MiB; one snapshot (memory cost per pending publish): "
          f"{publisher.times.snapshot_bytes / 2**20:.1f} MiB")
    for system in SYSTEMS:
        update = statistics.median(results[system]["update"])
        idle = statistics.median(results[system]["idle"])
        line = (f"{system:>10}: update {update * 1e3:8.1f} ms (median), idle on publish "
                f"{idle * 1e3:8.1f} ms = {100 * idle / update:5.1f}% of the update")
        if results[system]["growth"]:
            line += f"; live JAX bytes after submit +{max(results[system]['growth']) / 2**20:.1f} MiB (max)"
        print(line)
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main(parse_args())
