"""GPU check: a few SPO++ updates of a small Qwen3 on the synthetic env, with throughput.

    python scripts/gpu_check.py --engine jax  [--updates 4] [--batch 32] [--size small]
    python scripts/gpu_check.py --engine vllm [--transfer ipc|nccl|fs] ...
    python scripts/gpu_check.py --engine fleet --servers N [--gpus-per-server G] [--inflight]

--engine jax   our embedded JAX engine (continuous batching, KV cache) + the JAX learner on
               the same accelerator. Needs only the main dependencies (no vLLM).
--engine vllm  vLLM's AsyncLLM in this process (`VllmInProcessEngine`) + the JAX learner;
               weights go to vLLM after every update by CUDA IPC (default, one GPU), NCCL
               (learner and vLLM on DIFFERENT GPUs: NCCL refuses two ranks on one device)
               or the filesystem (`fs`). Needs `pip install -e .[vllm]` with a CUDA torch.
               The in-process and IPC/NCCL paths were written against vLLM 0.32 and have
               NOT been run on a GPU by their author (no GPU vLLM was available).
--engine fleet N local `vllm serve` processes (`VllmServerLauncher`, GPUs 1.. in blocks of
               --gpus-per-server; run with CUDA_VISIBLE_DEVICES=0 so the JAX learner holds
               GPU 0) behind `VllmFleetEngine`; weights by the filesystem publish, in
               flight (pause "keep" -> load -> resume) with --inflight. Server logs under
               <workdir>/servers. NOT run yet: no GPU machine was available to its author.

Printed (one JSON line per phase, then a summary line):
  * per update: learner step time and learner tokens/s (real tokens of the padded batch,
    forward+backward+AdamW), rollout tokens sampled, publish (weight sync) time;
  * decode burst after training: `--burst` concurrent requests x `--burst-tokens` new
    tokens each, tokens/s of wall time (prefill included), after a warm-up round;
  * the hardware (jax.devices(), host), so numbers are never quoted without it.

Run it through scripts/gpu_check.sh (sets memory fractions so JAX and vLLM share a GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # runnable from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {
    # tiny: CPU-friendly; small: ~30M parameters, head_dim 64 (fits every vLLM backend).
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("jax", "vllm", "fleet"), default="jax")
    parser.add_argument("--servers", type=int, default=1, help="fleet: local vLLM servers to launch")
    parser.add_argument("--gpus-per-server", type=int, default=1, help="fleet: GPUs per server (from GPU 1)")
    parser.add_argument("--inflight", action="store_true", help="publish in flight (SPEC 3) instead of draining")
    parser.add_argument("--transfer", choices=("ipc", "nccl", "fs"), default="ipc")
    parser.add_argument("--size", choices=tuple(SIZES), default="small")
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--num-tasks", type=int, default=32)
    parser.add_argument("--slots", type=int, default=64, help="JAX engine slots / vLLM max_num_seqs")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--burst-tokens", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="where the tokenizer / policy folders go (default: tmp)")
    return parser.parse_args(argv)


def emit(kind: str, **fields) -> None:
    print(json.dumps({"kind": kind, **fields}), flush=True)


def hardware() -> dict:
    import jax

    devices = jax.devices()
    return dict(backend=jax.default_backend(), devices=[d.device_kind for d in devices],
                num_devices=len(devices), host=platform.node(), cpu_count=os.cpu_count(),
                python=platform.python_version(), jax=jax.__version__)


def corpus(num_tasks: int) -> list[str]:
    from rollout_bridge.envs.synthetic import WORDS, make_task, render_observation

    texts = []
    for task_id in range(num_tasks):
        task = make_task(task_id, max_turns=2, max_filler=6)
        texts += [render_observation(task, r) for r in range(len(task.words))]
    return (texts + list(WORDS) + ["Correct. Done.", "Wrong."]) * 4


class CountingEngine:
    """Delegates to an engine and counts sampled tokens (the orchestrator sees the same API)."""

    def __init__(self, engine, inflight: bool = False, launcher=None):
        self.engine = engine
        self.inflight = inflight
        self.launcher = launcher  # fleet: the server processes, stopped on close
        self.sampled_tokens = 0

    @property
    def policy_event(self):
        return self.engine.policy_event

    async def generate(self, prompt_ids, params):
        result = await self.engine.generate(prompt_ids, params)
        self.sampled_tokens += len(result.token_ids)
        return result

    @property
    def supports_inflight_publish(self):
        return self.engine.supports_inflight_publish

    async def publish_inflight(self, weights, policy_event):
        start = time.perf_counter()
        await self.engine.publish_inflight(weights, policy_event)
        emit("publish", policy_event=policy_event, inflight=True, seconds=round(time.perf_counter() - start, 4))

    async def publish(self, weights, policy_event):
        start = time.perf_counter()
        if self.inflight:
            await self.engine.publish_inflight(weights, policy_event)
        else:
            await self.engine.publish(weights, policy_event)
        emit("publish", policy_event=policy_event, inflight=self.inflight,
             seconds=round(time.perf_counter() - start, 4))

    async def abort_all(self):
        await self.engine.abort_all()

    async def close(self):
        await self.engine.close()
        if self.launcher is not None:
            await asyncio.to_thread(self.launcher.close)


class TimedLearner:
    """SPO++ learner step (spopp_jax.learner) with wall time and token counts per update."""

    def __init__(self, model, lr: float):
        import jax

        from spopp_jax import learner as learner_lib

        config = learner_lib.LearnerConfig(num_micro_batches=1, length_bucket=None, num_mini_batches=1, action_logits_fraction=None, learning_rate=lr)
        self.model_def, self.state = learner_lib.init_train_state(model, config)
        self.train_step = learner_lib.make_train_step(self.model_def, config)
        self.jax = jax
        self.records: list[dict] = []

    def __call__(self, learner_input):
        import numpy as np

        from rollout_bridge.orchestrator import LearnerOutput

        batch = learner_input.batch
        start = time.perf_counter()
        self.state, metrics = self.train_step(self.state, batch)
        self.jax.block_until_ready(self.state.params)
        seconds = time.perf_counter() - start
        tokens = int(np.asarray(batch.attention_mask).sum())
        record = dict(update=len(self.records) + 1, learner_s=round(seconds, 4), batch_tokens=tokens,
                      padded_shape=list(np.asarray(batch.input_ids).shape),
                      learner_tokens_per_s=round(tokens / seconds, 1),
                      loss=float(metrics["loss"]), action_tokens=float(metrics.get("tokens", 0.0)))
        self.records.append(record)
        emit("update", **record)
        return LearnerOutput(weights=self.model_def.merge(self.state.params),
                             metrics={k: float(v) for k, v in metrics.items()})


async def build_engine(args, model, folder0: str, tokenizer_dir: str, root: str):
    if args.engine == "jax":
        from rollout_bridge.engine.jax_engine import JaxEngine

        return JaxEngine(model, num_slots=args.slots, max_len=args.max_len, steps_per_call=8, seed=args.seed,
                         min_prefill_len=64)
    if args.engine == "fleet":
        return await build_fleet(args, folder0, tokenizer_dir, root)
    from rollout_bridge.engine.vllm_inprocess import VllmInProcessConfig, VllmInProcessEngine
    from rollout_bridge.engine.vllm_weights import DirectTransferConfig

    direct = None if args.transfer == "fs" else DirectTransferConfig(backend=args.transfer, packed=True)
    config = VllmInProcessConfig(
        model=folder0, weights_root=root, tokenizer_dir=tokenizer_dir, dtype="float32",
        max_model_len=args.max_len, max_num_seqs=args.slots,
        gpu_memory_utilization=float(os.environ.get("SPOPP_VLLM_GPU_FRACTION", "0.35")),
        direct_transfer=direct, engine_kwargs=dict(enforce_eager=False),
    )
    return await VllmInProcessEngine.create(config)


async def build_fleet(args, folder0: str, tokenizer_dir: str, root: str):
    """(fleet engine, launcher): ``--servers`` local vLLM servers on GPUs 1.., health-checked."""
    from rollout_bridge.engine.vllm_fleet import VllmFleetConfig, VllmFleetEngine
    from rollout_bridge.engine.vllm_launcher import ServerLaunchConfig, VllmServerLauncher

    launch = ServerLaunchConfig(
        count=args.servers, gpus_per_server=args.gpus_per_server, first_gpu=1, capacity=args.slots,
        max_model_len=args.max_len, max_num_seqs=args.slots,
        extra_args=("--dtype", "float32", "--gpu-memory-utilization",
                    os.environ.get("SPOPP_VLLM_GPU_FRACTION", "0.8")),
        python=os.environ.get("SPOPP_VLLM_PYTHON"))  # an interpreter with vLLM, default this one
    launcher = VllmServerLauncher(launch, folder0, str(Path(root).parent / "servers"))
    specs = launcher.start()
    try:
        await asyncio.to_thread(launcher.wait_ready)
    except BaseException:
        launcher.close()
        raise
    engine = VllmFleetEngine(VllmFleetConfig(servers=tuple(specs), weights_root=root, tokenizer_dir=tokenizer_dir,
                                             initial_folder=folder0))
    await engine.start()
    return engine, launcher


async def decode_burst(engine, vocab_size: int, args) -> dict:
    """Throughput of ``burst`` concurrent requests (after one warm-up round)."""
    import numpy as np

    from rollout_bridge.engine.base import SamplingParams

    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_new_tokens=args.burst_tokens)
    prompts = [rng.integers(0, vocab_size, size=32).tolist() for _ in range(args.burst)]
    rounds = []
    for _ in range(2):
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        seconds = time.perf_counter() - start
        rounds.append((sum(len(r.token_ids) for r in results), seconds))
    tokens, seconds = rounds[-1]
    return dict(concurrency=args.burst, new_tokens_each=args.burst_tokens, tokens=tokens,
                seconds=round(seconds, 3), decode_tokens_per_s=round(tokens / seconds, 1),
                warmup_seconds=round(rounds[0][1], 3))


async def run(args) -> dict:
    from rollout_bridge.agent import AgentConfig, ChatFormat
    from rollout_bridge.engine.base import SamplingParams
    from rollout_bridge.engine.vllm_weights import write_policy_folder
    from rollout_bridge.envs.synthetic import SyntheticEnv
    from rollout_bridge.orchestrator import Orchestrator, OrchestratorConfig
    from rollout_bridge.tokenizer import build_tiny_tokenizer
    from spopp_jax.models import ModelConfig, init_model
    from spopp_jax.priors import jeffreys_prior
    import numpy as np

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="spopp-gpu-check-"))
    tokenizer_dir = workdir / "tokenizer"
    tokenizer = build_tiny_tokenizer(corpus(args.num_tasks), tokenizer_dir, vocab_size=512)
    chat = ChatFormat.from_tokenizer(tokenizer)
    hf = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=len(tokenizer),
              max_position_embeddings=max(args.max_len, 512), rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, attention_bias=False,
              hidden_act="silu", **SIZES[args.size])
    model = init_model(ModelConfig.from_hf(hf), seed=args.seed)
    root = str(workdir / "policies")
    folder0 = write_policy_folder(model, root, 0, tokenizer_dir) if args.engine != "jax" else ""

    setup_start = time.perf_counter()
    built = await build_engine(args, model, folder0, str(tokenizer_dir), root)
    inner, launcher = built if args.engine == "fleet" else (built, None)
    engine = CountingEngine(inner, inflight=args.inflight, launcher=launcher)
    emit("engine_ready", engine=args.engine, transfer=args.transfer if args.engine == "vllm" else None,
         servers=args.servers if args.engine == "fleet" else None, inflight=args.inflight,
         seconds=round(time.perf_counter() - setup_start, 2))
    learner = TimedLearner(model, args.lr)
    orchestrator = Orchestrator(
        engine, lambda: SyntheticEnv(num_tasks=args.num_tasks, max_turns=2, max_filler=6), chat, learner,
        args.num_tasks,
        OrchestratorConfig(batch_size=args.batch, max_in_flight=args.slots, pad_to_multiple=64, seed=args.seed,
                           drain="finish"),
        AgentConfig(max_turns=2, max_total_tokens=args.max_len,
                    sampling=SamplingParams(max_new_tokens=args.max_new_tokens)),
        # Offline prior with varied success counts: baselines, hence advantages and the
        # gradient, are non-zero even while the random model never succeeds.
        *jeffreys_prior(np.arange(args.num_tasks) % 9, np.full(args.num_tasks, 8)),
    )
    start = time.perf_counter()
    try:
        await orchestrator.run(args.updates)
        train_s = time.perf_counter() - start
        burst = await decode_burst(engine, len(tokenizer), args)
        emit("decode_burst", **burst)
    finally:
        await orchestrator.close()
        await engine.close()
    steady = learner.records[1:] or learner.records  # the first step includes compilation
    summary = dict(
        engine=args.engine, size=args.size, updates=orchestrator.updates, policy_event=orchestrator.policy_event,
        wall_s=round(train_s, 2), rollout_tokens=engine.sampled_tokens,
        rollout_tokens_per_s=round(engine.sampled_tokens / train_s, 1),
        learner_tokens_per_s=round(sum(r["batch_tokens"] for r in steady) / sum(r["learner_s"] for r in steady), 1),
        # A new padded batch shape recompiles the step: the best update shows the
        # compiled speed, the mean above includes any recompilation.
        learner_tokens_per_s_best=max(r["learner_tokens_per_s"] for r in steady),
        decode_tokens_per_s=burst["decode_tokens_per_s"], failed=orchestrator.failed, hardware=hardware(),
    )
    emit("summary", **summary)
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    emit("hardware", **hardware())
    summary = asyncio.run(run(args))
    return 0 if summary["updates"] == args.updates and summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
