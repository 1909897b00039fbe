"""A vLLM rollout server for the fleet, on any node: ``python -m rollout_bridge.serve``.

    PYTHONPATH=<repo> python -m rollout_bridge.serve --model /path/to/hf_folder --port 8000 \\
        [--weights-dir DIR] [--keep-policies N] [any other `vllm serve` flag]
    spopp-serve ...        # the same, where this package is installed in vLLM's environment

Then ``python train.py --rollout.engine vllm_server --rollout.engine.server_urls http://node:8000``.
Runs in vLLM's environment (needs vLLM and the standard library; neither JAX nor the rest
of this project's dependencies). It starts vLLM's OpenAI-compatible API server with what
`VllmFleetEngine` needs, the flags `vllm_fleet.vllm_server_argv` passes to launched servers:

* ``VLLM_SERVER_DEV_MODE=1`` (``/collective_rpc``, ``/pause``, ``/resume``) and the worker
  extension ``vllm_worker_ext.SpoppWorkerExtension`` importable by every worker process
  (its folder on ``PYTHONPATH``), ``--worker-extension-cls`` set to it;
* ``--served-model-name policy``, ``--generation-config vllm``, ``--logprobs-mode
  raw_logprobs`` unless given (another ``--logprobs-mode`` or worker extension is refused:
  the fleet's log-probs and weight reloads depend on them);

and adds the policy upload routes (`vllm_upload`): the trainer sends each policy folder
over HTTP into ``--weights-dir`` (default: a fresh folder in ``/dev/shm``, i.e. memory,
removed at exit; the newest ``--keep-policies`` folders are kept), so the server needs no
filesystem shared with the trainer. ``--model`` is only the start-up weights (any folder
with the policy's architecture and tokenizer): the fleet loads the current policy into a
server before its first request, and again when a restarted server answers.
"""

import argparse
import asyncio
import atexit
import os
import shutil
import sys
import tempfile
from typing import Sequence

from rollout_bridge.engine.vllm_fleet import FLEET_SERVER_FLAGS, vllm_server_env
from rollout_bridge.engine.vllm_upload import COMMIT_ROUTE, FILE_ROUTE, PolicyInbox

PROG = "python -m rollout_bridge.serve"


def split_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this entry point's own options, the `vllm serve` arguments with the fleet's flags
    added where absent). Raises SystemExit(2) with one line on a conflicting flag."""
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)  # vLLM flags pass untouched
    parser.add_argument("--weights-dir", default=None)
    parser.add_argument("--keep-policies", type=int, default=2)
    own, rest = parser.parse_known_args(list(argv))
    if own.keep_policies < 1:
        parser.error(f"--keep-policies must be >= 1, got {own.keep_policies}")
    given = {}
    for i, arg in enumerate(rest):
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            given[name] = value or (rest[i + 1] if i + 1 < len(rest) else "")
    vllm_args = list(rest)
    for flag, value in FLEET_SERVER_FLAGS:
        if flag not in given:
            vllm_args += [flag, value]
        elif flag in ("--logprobs-mode", "--worker-extension-cls") and given[flag] != value:
            parser.error(f"{flag} {given[flag]}: the fleet needs {flag} {value}")
    return own, vllm_args


def policy_routes(inbox: PolicyInbox):
    """A FastAPI router with the upload routes of `vllm_upload` over ``inbox``. (No
    ``from __future__ import annotations`` in this module: FastAPI reads the handlers'
    annotations as objects, ``Request`` included.)"""
    from fastapi import APIRouter, Request
    from fastapi.responses import JSONResponse

    router = APIRouter()

    @router.put(FILE_ROUTE)
    async def put_policy_file(policy_event: str, name: str, request: Request):
        try:
            f = inbox.open_file(policy_event, name)
        except ValueError as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        size = 0
        with f:
            async for chunk in request.stream():
                await asyncio.to_thread(f.write, chunk)
                size += len(chunk)
        return {"bytes": size}

    @router.post(COMMIT_ROUTE)
    async def commit_policy(policy_event: str, request: Request):
        try:
            body = await request.json()
            folder = await asyncio.to_thread(inbox.commit, policy_event, body["files"])
        except (ValueError, KeyError, TypeError) as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        return {"folder": folder, "policy_event": int(policy_event)}

    return router


def install_policy_routes(inbox: PolicyInbox) -> None:
    """Make vLLM's API server add the upload routes to the app it builds."""
    from vllm.entrypoints.launchers.api_server import entry

    build_app = entry.build_app

    def build_app_with_uploads(*args, **kwargs):
        app = build_app(*args, **kwargs)
        app.include_router(policy_routes(inbox))
        return app

    entry.build_app = build_app_with_uploads


def weights_dir(requested: str | None) -> str:
    """``requested``, or a fresh memory-backed folder removed at exit."""
    if requested is not None:
        os.makedirs(requested, exist_ok=True)
        return os.path.abspath(requested)
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    folder = tempfile.mkdtemp(prefix="spopp-policies-", dir=shm)
    atexit.register(shutil.rmtree, folder, True)
    return folder


def main(argv: Sequence[str] | None = None) -> None:
    own, vllm_args = split_args(sys.argv[1:] if argv is None else argv)
    os.environ.update(vllm_server_env(os.environ))  # before vLLM reads its settings
    ext_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine")
    if ext_dir not in sys.path:
        sys.path.insert(0, ext_dir)
    inbox = PolicyInbox(weights_dir(own.weights_dir), keep=own.keep_policies)
    print(f"{PROG}: policy uploads go to {inbox.root}; vllm serve {' '.join(vllm_args)}", flush=True)
    install_policy_routes(inbox)
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

    sys.argv = [PROG, *vllm_args]
    vllm_main()


if __name__ == "__main__":
    main()
