"""The ``vllm`` choice of ``rollout.engine``: vLLM's AsyncLLM inside the trainer process.

It lives apart from ``vllm_inprocess.py`` (the engine it builds) because that module also runs
inside the vLLM virtual environment (scripts/setup_vllm_cpu.sh, the servers of
``rollout_bridge.serve``), which has none of the run config's dependencies (draccus, JAX):
``tests/test_vllm_venv_imports.py`` imports what that venv imports with them blocked.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_bridge.engine.choice import EngineConfig, check_vllm_temperature
from rollout_bridge.engine.vllm_inprocess import DeferredInProcessEngine, InProcessVllm, VllmInProcessConfig


@EngineConfig.register_subclass("vllm")
@dataclass(frozen=True)
class VllmEngineConfig(InProcessVllm, EngineConfig):
    """``rollout.engine: vllm``: vLLM's AsyncLLM in this process (``DeferredInProcessEngine``).
    Its fields are vLLM's own settings (`InProcessVllm`: ``dtype``, ``gpu_memory_utilization``,
    checked there); its model folder, context length, concurrency and drain are the job's
    (the stage's policy written as a weight folder, rollout.max_total_tokens,
    rollout.max_in_flight, rollout.drain). The record key is the engine's name and, when it is
    not ``auto``, ``dtype`` (the compute dtype changes what the policy samples, so a prior or an
    evaluation made at one dtype is not reused at another); ``gpu_memory_utilization`` is not
    keyed (how much memory vLLM takes, not what it computes)."""

    def record_key(self) -> dict:
        """The engine in a stage key: ``dtype`` only when set (records made at ``auto``, the
        default, were written before it existed and stay valid)."""
        key = super().record_key()
        return key if self.dtype == "auto" else {**key, "dtype": self.dtype}

    def check_runnable(self, rollout) -> None:
        """Temperature 1 (raw log-probs) and vllm importable here."""
        import importlib.util
        import sys

        check_vllm_temperature(self.name, rollout)
        if importlib.util.find_spec("vllm") is None:
            raise ValueError("rollout.engine=vllm runs vLLM inside this process, but vllm is not importable here "
                             f"({sys.executable}); on a CPU host use rollout.engine=vllm_server with "
                             "rollout.engine.launch.python <repo>/.venv-vllm/bin/python (scripts/setup_vllm_cpu.sh)")

    def inprocess_config(self, folder: str, root: str, tokenizer: str | None, policy_event: int, agent,
                         orchestrator) -> VllmInProcessConfig:
        """The engine's arguments: vLLM's settings of this section, the policy folder
        ``folder`` under ``root`` (its ``tokenizer`` folder), the job's context length (the
        agent's), concurrency and drain (the orchestrator's)."""
        return VllmInProcessConfig(dtype=self.dtype, gpu_memory_utilization=self.gpu_memory_utilization,
                                   model=folder, weights_root=root, tokenizer_dir=tokenizer,
                                   initial_policy_event=int(policy_event),
                                   max_model_len=agent.max_total_tokens, max_num_seqs=orchestrator.max_in_flight,
                                   drain="abort" if orchestrator.drain == "abort" else "finish")

    def build(self, model, agent, orchestrator, policy_event: int, seed: int, servers=None,
              policy_folder=None, run_dir=None) -> DeferredInProcessEngine:
        """The stage's model written as a policy folder under ``run_dir/rollout_vllm``, vLLM's
        AsyncLLM created on first use."""
        import tempfile
        from pathlib import Path

        from rollout_bridge.engine.vllm_weights import write_policy_folder

        if run_dir is None:
            raise ValueError("rollout.engine=vllm: the engine needs run_dir (the weight folders go there)")
        parent = Path(run_dir) / "rollout_vllm"
        parent.mkdir(parents=True, exist_ok=True)
        root = tempfile.mkdtemp(prefix="engine-", dir=parent)
        tokenizer = None if policy_folder is None else str(policy_folder)
        folder = write_policy_folder(model, root, int(policy_event), tokenizer)
        return DeferredInProcessEngine(self.inprocess_config(folder, root, tokenizer, policy_event, agent,
                                                             orchestrator))


__all__ = ["VllmEngineConfig"]
