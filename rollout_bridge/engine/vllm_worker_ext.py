"""Worker extension loaded INSIDE every vLLM worker (``--worker-extension-cls``).

vLLM mixes this class into its worker class, so its methods become callable through
``collective_rpc`` (in-process: ``AsyncLLM.collective_rpc``; servers: the dev-mode
``POST /collective_rpc`` endpoint, which passes string arguments only).

It adds two things vLLM lacks for SPO++ (SPEC 2, "policy event"):
  * ``spopp_load_policy(folder, policy_event)``: reload the weights in place from a
    published HF safetensors folder (vLLM's own ``reload_weights(weights_path=...)``)
    and remember which policy event they are;
  * ``spopp_policy_event()``: the policy event of the weights this worker holds, so the
    bridge can confirm a server's version before dispatching to it.

This module runs in vLLM's environment (it may lack jax and the rest of this package):
it imports only the standard library. Servers load it as a top-level module
(``vllm_worker_ext.SpoppWorkerExtension`` with this folder on ``PYTHONPATH``) so that
importing it never executes ``rollout_bridge/__init__.py``.
"""

from __future__ import annotations

import json
import os

POLICY_MARKER = "spopp_policy.json"
UNKNOWN_POLICY_EVENT = -1


def read_policy_marker(folder: str) -> int:
    """The policy event written next to the weights of ``folder`` (-1 when absent)."""
    path = os.path.join(folder, POLICY_MARKER)
    if not os.path.exists(path):
        return UNKNOWN_POLICY_EVENT
    with open(path) as f:
        return int(json.load(f)["policy_event"])


class SpoppWorkerExtension:
    """Mixin for vLLM's worker: versioned in-place weight reload from a folder."""

    def spopp_load_policy(self, folder: str, policy_event: str) -> int:
        """Reload weights from ``folder`` and record them as ``policy_event``.

        ``policy_event`` arrives as a string (the HTTP RPC passes strings only); it must
        agree with the folder's ``spopp_policy.json`` marker so a stale or half-written
        folder is refused rather than served under the wrong version.
        """
        expected = int(policy_event)
        on_disk = read_policy_marker(folder)
        if on_disk != expected:
            raise ValueError(
                f"folder {folder!r} holds policy event {on_disk}, expected {expected}"
            )
        self.reload_weights(weights_path=folder, is_checkpoint_format=True)
        self._spopp_policy_event = expected
        return expected

    def spopp_set_policy_event(self, policy_event: str) -> int:
        """Record the policy event of weights loaded by another path (start-up, NCCL)."""
        self._spopp_policy_event = int(policy_event)
        return self._spopp_policy_event

    def spopp_policy_event(self) -> int:
        """The policy event of the weights this worker holds (-1 before any is set)."""
        return int(getattr(self, "_spopp_policy_event", UNKNOWN_POLICY_EVENT))
