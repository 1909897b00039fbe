#!/usr/bin/env bash
# GPU check of the SPO++ stack.
#
#   scripts/gpu_check.sh [--cpu]          # one VERDICT line per check (scripts/gpu_check_verdicts.py):
#                                         # bf16 mixed-precision learner step + MFU, cuDNN attention
#                                         # parity, engine decode, Qwen3.5 tiny, memory settings, vLLM;
#                                         # <= 8 min on one H100; --cpu: toy sizes on CPU (a dry run)
#   scripts/gpu_check.sh [jax|vllm|fleet|fleet-train|attention|all] [extra args for scripts/gpu_check.py / train.py]
#
#   jax   embedded JAX engine + JAX learner on the accelerator (no vLLM needed).
#   vllm  vLLM in-process (AsyncLLM) + JAX learner, weights by CUDA IPC after each update
#         (pass --transfer nccl|fs to change). Needs `pip install -e .[vllm]` (CUDA torch).
#   fleet learner on GPU 0, N local `vllm serve` processes on the other GPUs (N = GPUs - 1,
#         or SPOPP_FLEET_SERVERS; SPOPP_FLEET_GPUS_PER_SERVER, default 1), weights by the
#         filesystem publish IN FLIGHT (pause keep -> load -> resume). Needs vLLM + 2 GPUs.
#         NOT run yet: written without a GPU machine.
#   fleet-train  the same fleet driven by train.py itself: a small TextWorld job (8 updates,
#         in-flight publishes) with `--rollout.engine vllm_server
#         --rollout.engine.launch.count N --rollout.engine.launch.first_gpu 1` (train.py
#         launches, health-checks and stops the servers; logs and servers.json under
#         <run>/rollout_servers; per-update rollout/* metrics in <run>/metrics.jsonl). Extra
#         args go to train.py. Needs vLLM + 2 GPUs. NOT run yet: written without a GPU machine.
#   attention  the full forward's fused attention on the GPU: cuDNN's kernel (chosen for
#         bfloat16) against the same call's XLA kernel and our own attention, values and
#         gradients on real tokens, plus one timing each. NOT run yet: written without a GPU.
#   all   jax, then vllm when `import vllm` works (default).
#
# JAX and vLLM share one GPU in vllm mode: JAX gets a fixed fraction of the memory
# (SPOPP_JAX_GPU_FRACTION, default 0.45) and vLLM another (SPOPP_VLLM_GPU_FRACTION, 0.35).
# Prints JSON lines (hardware, per-update learner time and tokens/s, publish time, decode
# burst tokens/s, summary). Exit status 0 only when every requested mode finished.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
MODE="${1:-check}"
if [[ "${MODE}" == --* ]]; then
  MODE=check            # flags only: they are the verdict script's (e.g. --cpu)
elif [[ $# -gt 0 ]]; then
  shift
fi
cd "${REPO_ROOT}"
export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
export TOKENIZERS_PARALLELISM=false

run_jax() {
  echo "== gpu_check: engine=jax ==" >&2
  "${PYTHON}" scripts/gpu_check.py --engine jax "$@"
}

run_vllm() {
  echo "== gpu_check: engine=vllm ==" >&2
  XLA_PYTHON_CLIENT_PREALLOCATE=false \
  XLA_PYTHON_CLIENT_MEM_FRACTION="${SPOPP_JAX_GPU_FRACTION:-0.45}" \
  SPOPP_VLLM_GPU_FRACTION="${SPOPP_VLLM_GPU_FRACTION:-0.35}" \
  VLLM_ALLOW_INSECURE_SERIALIZATION=1 \
    "${PYTHON}" scripts/gpu_check.py --engine vllm "$@"
}

run_fleet() {
  local gpus servers
  gpus="$(nvidia-smi -L 2>/dev/null | wc -l)"
  servers="${SPOPP_FLEET_SERVERS:-$(( (gpus - 1) / ${SPOPP_FLEET_GPUS_PER_SERVER:-1} ))}"
  if (( servers < 1 )); then
    echo "== gpu_check: fleet mode needs >= 2 GPUs (found ${gpus}) ==" >&2
    return 1
  fi
  echo "== gpu_check: engine=fleet, ${servers} server(s) ==" >&2
  # The learner sees GPU 0 only; each server gets its own CUDA_VISIBLE_DEVICES block.
  CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false \
    "${PYTHON}" scripts/gpu_check.py --engine fleet --servers "${servers}" \
      --gpus-per-server "${SPOPP_FLEET_GPUS_PER_SERVER:-1}" --inflight "$@"
}

run_fleet_train() {
  local gpus per_server servers run_dir
  gpus="$(nvidia-smi -L 2>/dev/null | wc -l)"
  per_server="${SPOPP_FLEET_GPUS_PER_SERVER:-1}"
  servers="${SPOPP_FLEET_SERVERS:-$(( (gpus - 1) / per_server ))}"
  if (( servers < 1 )); then
    echo "== gpu_check: fleet-train mode needs >= 2 GPUs (found ${gpus}) ==" >&2
    return 1
  fi
  run_dir="${SPOPP_FLEET_TRAIN_DIR:-runs/gpu_check_fleet_train_$(date +%s)}"
  echo "== gpu_check: train.py on ${servers} launched vLLM server(s), run folder ${run_dir} ==" >&2
  # The learner (train.py) sees GPU 0 only; the launcher gives server i GPUs
  # first_gpu + i*gpus_per_server ... (CUDA_VISIBLE_DEVICES, physical ids).
  CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false \
    "${PYTHON}" train.py --output_dir "${run_dir}" --steps 8 --checkpoint_every 4 --progress false \
      --model.tiny_head_dim 32 --rollout.drain none \
      --rollout.engine vllm_server --rollout.engine.launch.count "${servers}" \
      --rollout.engine.launch.gpus_per_server "${per_server}" --rollout.engine.launch.first_gpu 1 \
      --rollout.engine.launch.extra_args "--gpu-memory-utilization 0.5 --dtype float32" "$@"
  "${PYTHON}" - "${run_dir}" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
last = rows[-1]
print(json.dumps({"updates": len(rows), "learner_idle_s_mean": sum(r["diag/learner_idle_s"] for r in rows) / len(rows),
                  "learner_s_mean": sum(r["learner_s"] for r in rows) / len(rows),
                  **{k: v for k, v in last.items() if k.startswith("rollout/")}}))
PY
}

run_attention() {
  echo "== gpu_check: fused attention (cudnn vs xla vs ours) ==" >&2
  "${PYTHON}" - <<'PY'
import json, time
import jax, jax.numpy as jnp, numpy as np
from spopp_jax.models.attention import (causal_block_attention, causal_query_block, fused_attention,
                                        fused_attention_implementation)
from spopp_jax.models.masks import sequence_layout
batch, time_, kv, groups, dim = 4, 1024, 4, 4, 128
rng = np.random.default_rng(0)
q = jnp.asarray(rng.normal(size=(batch, time_, kv, groups, dim)), jnp.bfloat16)
k, v = (jnp.asarray(rng.normal(size=(batch, time_, kv, dim)), jnp.bfloat16) for _ in range(2))
lengths = np.array([time_, time_ - 100, time_ // 2, 17])[:batch]
mask = np.arange(time_)[None, :] < lengths[:, None]
layout = sequence_layout(jnp.zeros((batch, time_), jnp.int32), jnp.asarray(mask))
real = jnp.asarray(mask, jnp.float32)[:, :, None, None, None]
kernels = {"cudnn": lambda q, k, v: fused_attention(q, k, v, layout, "cudnn"),
           "xla": lambda q, k, v: fused_attention(q, k, v, layout, "xla"),
           "ours": lambda q, k, v: causal_block_attention(q, k, v, layout, causal_query_block(time_))}
report = {"chosen": fused_attention_implementation(q.dtype, dim), "device": str(jax.devices()[0])}
outs = {}
for name, attend in kernels.items():
    step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * real),
                                      argnums=(0, 1, 2)))
    jax.block_until_ready(step(q, k, v))
    start = time.perf_counter()
    for _ in range(10):
        outs[name] = jax.block_until_ready(step(q, k, v))
    report[f"{name}_fwd_bwd_ms"] = (time.perf_counter() - start) * 100
for name in ("cudnn", "ours"):
    for label, got, want in zip(("loss", "dq", "dk", "dv"), (outs[name][0], *outs[name][1]),
                                (outs["xla"][0], *outs["xla"][1])):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        report[f"{name}_vs_xla_{label}_max_rel"] = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))
print(json.dumps(report))
ok = report["chosen"] == "cudnn" and all(v < 2e-2 for key, v in report.items() if key.endswith("_max_rel"))
raise SystemExit(0 if ok else 1)
PY
}

have_vllm() { "${PYTHON}" -c "import vllm" >/dev/null 2>&1; }

case "${MODE}" in
  check) timeout "${SPOPP_GPU_CHECK_TIMEOUT_S:-480}" "${PYTHON}" scripts/gpu_check_verdicts.py "$@" ;;
  jax) run_jax "$@" ;;
  vllm) run_vllm "$@" ;;
  fleet) run_fleet "$@" ;;
  fleet-train) run_fleet_train "$@" ;;
  attention) run_attention ;;
  all)
    run_jax "$@"
    if have_vllm; then
      run_vllm "$@"
    else
      echo "== gpu_check: vllm not importable with ${PYTHON}: vllm mode skipped (pip install -e .[vllm]) ==" >&2
    fi
    ;;
  *) echo "usage: $0 [--cpu] | [check|jax|vllm|fleet|fleet-train|attention|all] [gpu_check.py / train.py args]" >&2; exit 2 ;;
esac
