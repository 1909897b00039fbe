"""The learner memory estimate (`spopp_jax.models.memory`) beside the measured peak CPU RSS
of a real train step, for the Qwen3.5 tiny config (3 Gated DeltaNet + 1 gated attention).

    python benchmarks/learner_memory.py [--lengths 1024 4096] [--remat none block]

Each case runs in a fresh process (so its peak is its own) that:
  1. imports jax and builds the batch, reads RSS (r0);
  2. builds the model and TrainState, reads RSS (r_state): measured state = r_state − r0,
     against the estimate's params + adam (+ the compute copy);
  3. compiles the step ahead of time, resets the peak (/proc/self/clear_refs), runs one
     step: measured step = peak RSS − RSS before the step, against the estimate's grads +
     activations + logits.
CPU RSS counts what the allocator holds (freed buffers it keeps, XLA's temporaries), so
the measured step is an upper view of what the step needed. The load average and CPU
model are printed with the numbers (a busy machine changes the timing, not the bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

MB = 1e6


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def qwen35_tiny():
    from spopp_jax.models import ModelConfig

    return ModelConfig(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                       layer_types=("linear_attention",) * 3 + ("full_attention",), model_type="qwen3_5_text",
                       attention_output_gate=True, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                       linear_key_head_dim=16, linear_value_head_dim=32, linear_num_key_heads=2,
                       linear_num_value_heads=4)


def one_case(time_: int, remat: str, compute: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from spopp_jax import learner
    from spopp_jax.models import init_model
    from spopp_jax.models.memory import estimate_learner_memory

    config = qwen35_tiny()
    rng = np.random.default_rng(0)
    action = np.zeros((1, time_), bool)
    action[:, 8:] = True
    batch = learner.TrainBatch(jnp.asarray(rng.integers(0, config.vocab_size, (1, time_)), jnp.int32),
                               jnp.ones((1, time_), bool), jnp.asarray(action),
                               jnp.asarray(np.where(action, -3.0, 0.0), jnp.float32),
                               jnp.ones((1, time_), jnp.float32))
    jax.block_until_ready(batch)
    r0 = rss_bytes()
    learner_cfg = learner.LearnerConfig(num_micro_batches=1, length_bucket=None, num_mini_batches=1, action_logits_fraction=None,
                                        learning_rate=1e-6, logprob_chunk_size=512)
    model = init_model(config, seed=0, dtype=compute, param_dtype="float32", remat=remat)
    model_def, state = learner.init_train_state(model, learner_cfg)
    del model
    jax.block_until_ready(state)
    r_state = rss_bytes()
    step = learner.make_train_step(model_def, learner_cfg).lower(state, batch).compile()
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS from here on
        f.write("5")
    before = rss_bytes()
    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    peak = rss_bytes("VmHWM")
    estimate = estimate_learner_memory(config, rows=1, time=time_, param_dtype="float32", compute_dtype=compute,
                                       remat=remat, logprob_chunk_size=512)
    return {"tokens": time_, "remat": remat, "compute": compute,
            "estimate_state_mb": (estimate.params + estimate.adam + estimate.compute_copy) / MB,
            "measured_state_mb": (r_state - r0) / MB,
            "estimate_step_mb": (estimate.grads + estimate.activations + estimate.logits) / MB,
            "measured_step_mb": (peak - before) / MB,
            "estimate_total_mb": estimate.total / MB, "measured_total_mb": (peak - r0) / MB,
            "loss_finite": bool(np.isfinite(float(metrics["loss"])))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--remat", nargs="+", default=["none", "block"])
    parser.add_argument("--compute", nargs="+", default=["float32"])
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case in this process
    args = parser.parse_args(argv)
    if args.case:
        time_, remat, compute = args.case.split(",")
        print(json.dumps(one_case(int(time_), remat, compute)))
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _hardware import cpu_model

    print(f"cpu: {cpu_model()}; load average {os.getloadavg()}")
    header = ("tokens", "remat", "compute", "estimate_state_mb", "measured_state_mb", "estimate_step_mb",
              "measured_step_mb", "estimate_total_mb", "measured_total_mb")
    print(" | ".join(header))
    for compute in args.compute:
        for remat in args.remat:
            for time_ in args.lengths:
                done = subprocess.run([sys.executable, __file__, "--case", f"{time_},{remat},{compute}"],
                                      capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
                if done.returncode:
                    print(f"{time_} {remat} {compute}: failed\n{done.stderr[-2000:]}")
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1])
                print(" | ".join(f"{row[k]:.1f}" if isinstance(row[k], float) else str(row[k]) for k in header),
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
