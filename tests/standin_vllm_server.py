"""A stand-in for one ``vllm serve`` process: the subset of the OpenAI / vLLM HTTP API that
``VllmFleetEngine`` uses, on 127.0.0.1 only, standard library only (no model).

    python tests/standin_vllm_server.py --port 8123 --model /some/folder

Completions return ``max_tokens`` copies of token 7 with log-prob -0.5; the worker
extension RPCs keep a policy event; ``/pause``/``/resume`` are absent (an older vLLM).
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN, LOGPROB = 7, -0.5


def make_handler(model_dir: str):
    state = {"policy_event": -1}

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
            else:
                self.reply(404)

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            path = self.path.split("?")[0]
            if path == "/collective_rpc":
                method, args = body["method"], body.get("args", [])
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
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args.model))
    print(f"stand-in vLLM server on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
