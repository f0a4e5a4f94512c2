"""A stand-in for vLLM's server, run by a fake venv's `bin/python` so the lifecycle and error paths
of `VllmServer` are tested without vLLM. FAKE_VLLM picks the behaviour:

    serve        /health, and /v1/completions answering each prompt with its reversed ids
    die          print a few log lines, exit 3
    hang         never answer (a server that never gets ready)
    ignore_term  serve, but ignore SIGTERM (stop must SIGKILL it)
"""

import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

argv = sys.argv[1:]
behaviour = os.environ.get("FAKE_VLLM", "serve")
if behaviour == "die":
    print("INFO loading model")
    print("ValueError: the model folder has no config.json")
    sys.exit(3)
if behaviour == "hang":
    time.sleep(600)
if behaviour == "ignore_term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

port = int(argv[argv.index("--port") + 1])
record = os.environ.get("FAKE_VLLM_RECORD")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status, doc):
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200 if self.path == "/health" else 404, {})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if record:
            with open(record, "a") as f:
                f.write(json.dumps(req) + "\n")
        if req.get("max_tokens", 0) > 100:
            self._send(400, {"error": {"message": "max_tokens is too large", "code": 400}})
            return
        choices = [
            {"index": i, "text": "", "token_ids": list(reversed(p))[: req["max_tokens"]]}
            for i, p in enumerate(req["prompt"])
        ]
        self._send(200, {"choices": choices[::-1]})  # out of order: the caller sorts by index


print(f"INFO fake vLLM {argv}", flush=True)
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
