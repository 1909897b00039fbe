"""A stand-in for one ``vllm serve`` process: the subset of the OpenAI / vLLM HTTP API that
``VllmFleetEngine`` uses, on 127.0.0.1 only, standard library only (no model).

    python tests/standin_vllm_server.py --port 8123 --model /some/folder [--weights-dir DIR]

Completions return ``max_tokens`` copies of token 7 with log-prob -0.5; the worker
extension RPCs keep a policy event; ``/pause``/``/resume`` are absent (an older vLLM).
With ``--weights-dir`` it also takes policy uploads as ``python -m rollout_bridge.serve``
does (`rollout_bridge.engine.vllm_upload.PolicyInbox`, listed in ``/openapi.json``), and
``spopp_load_policy`` runs the real worker extension's check (the folder's marker must
hold the event); ``GET /standin/loads`` lists the (folder, event) loads so far.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN, LOGPROB = 7, -0.5


def make_handler(model_dir: str, weights_dir: str | None = None):
    state = {"policy_event": -1, "loads": []}
    loads: list = []
    inbox = worker = None
    if weights_dir is not None:
        sys.path.insert(0, REPO)
        from rollout_bridge.engine.vllm_upload import COMMIT_ROUTE, FILE_ROUTE, ROUTE_PREFIX, PolicyInbox
        from rollout_bridge.engine.vllm_worker_ext import SpoppWorkerExtension

        class StandinWorker(SpoppWorkerExtension):
            def reload_weights(self, weights_path, is_checkpoint_format):
                loads.append(weights_path)

        inbox, worker = PolicyInbox(weights_dir), StandinWorker()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep the server log short
            pass

        def reply(self, status: int, payload: dict | None = None) -> None:
            body = json.dumps(payload or {}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self.reply(200)
            elif self.path == "/v1/models":
                self.reply(200, {"data": [{"id": "policy", "root": model_dir}]})
            elif self.path == "/openapi.json" and inbox is not None:
                self.reply(200, {"paths": {COMMIT_ROUTE: {"post": {}}, FILE_ROUTE: {"put": {}}}})
            elif self.path == "/standin/loads":
                self.reply(200, {"loads": [[folder, event] for folder, event in zip(loads, state["loads"])]})
            else:
                self.reply(404)

        def do_PUT(self):
            length = int(self.headers.get("Content-Length") or 0)
            parts = self.path.split("?")[0].split("/")  # "", spopp, policy, <event>, files, <name>
            if inbox is None or len(parts) != 6 or "/".join(parts[:3]) != ROUTE_PREFIX or parts[4] != "files":
                self.reply(404)
                return
            try:
                with inbox.open_file(parts[3], parts[5]) as f:
                    f.write(self.rfile.read(length))
            except ValueError as error:
                self.reply(400, {"error": str(error)})
                return
            self.reply(200, {"bytes": length})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            path = self.path.split("?")[0]
            if inbox is not None and path.startswith(ROUTE_PREFIX + "/") and path.endswith("/commit"):
                event = path.split("/")[3]
                try:
                    self.reply(200, {"folder": inbox.commit(event, body["files"]), "policy_event": int(event)})
                except ValueError as error:
                    self.reply(400, {"error": str(error)})
            elif path == "/collective_rpc":
                method, args = body["method"], body.get("args", [])
                if method == "spopp_load_policy" and worker is not None:
                    try:
                        worker.spopp_load_policy(*args)
                    except (ValueError, OSError) as error:
                        self.reply(500, {"error": str(error)})
                        return
                    state["loads"].append(int(args[1]))
                if method in ("spopp_set_policy_event", "spopp_load_policy"):
                    state["policy_event"] = int(args[-1])
                self.reply(200, {"results": [str(state["policy_event"])]})
            elif path == "/v1/completions":
                n = int(body["max_tokens"])
                self.reply(200, {"choices": [{
                    "token_ids": [TOKEN] * n, "finish_reason": "length",
                    "logprobs": {"token_logprobs": [LOGPROB] * n, "tokens": [f"token_id:{TOKEN}"] * n}}]})
            elif path == "/reset_prefix_cache":
                self.reply(200, {"success": True})
            elif path in ("/update_weight_version", "/abort_requests"):
                self.reply(200)
            else:
                self.reply(404)

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--weights-dir", default=None)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args.model, args.weights_dir))
    print(f"stand-in vLLM server on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
