"""A stand-in for llama.cpp's venv Python, run by a fake venv's `bin/python`, so the F32 GGUF
plumbing, `LlamacppServer`'s lifecycle and the load client's reading of llama.cpp's stream are
tested without llama.cpp. It answers the two ways `dspark.servers.llamacpp` runs that Python:

    -c CODE SRC DST THREADS   the F32 conversion: writes DST from SRC (FAKE_LLAMACPP=convert_fail:
                              prints an error, writes half a file and exits 1)
    -m llama_cpp.server ...   the OpenAI server (FAKE_LLAMACPP=die: print a few lines, exit 3)

The server streams as llama-cpp-python 0.3.36 does: text only (no token ids, no usage), a chunk
per token except that the tokens of one multi-byte character go out together, no EOS, a last
chunk with empty text and the finish reason, SSE ping comments; it takes prompts as text only
(422 for token ids, as its request model does) and serves one request at a time. A prompt
containing "short" ends in EOS after two tokens; any other runs to max_tokens. Every request
(and the argv) is appended to FAKE_LLAMACPP_RECORD.
"""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

argv = sys.argv[1:]
behaviour = os.environ.get("FAKE_LLAMACPP", "serve")
record = os.environ.get("FAKE_LLAMACPP_RECORD")


def note(doc) -> None:
    if record:
        with open(record, "a") as f:
            f.write(json.dumps(doc) + "\n")


if argv[0] == "-c":
    src, dst = argv[2], argv[3]
    note({"convert": [src, dst]})
    with open(dst, "wb") as f:
        f.write(b"GGUF fake F32 of " + src.encode())
    if behaviour == "convert_fail":
        print("llama_model_quantize: failed to quantize: unknown model type", file=sys.stderr)
        sys.exit(1)
    sys.exit(0)

note({"argv": argv})
if behaviour == "die":
    print("llama_model_load: loading model")
    print("ValueError: Failed to load model from file")
    sys.exit(3)

port = int(argv[argv.index("--port") + 1])
alias = argv[argv.index("--model_alias") + 1]
# (text, tokens): what a long completion streams, cycling; "日" is three byte tokens.
PIECES = [("A", 1), ("日", 3), (" c", 1), (" d", 1)]


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
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": alias, "object": "model"}]})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        note(req)
        if self.path == "/extras/tokenize":
            self._send(200, {"tokens": [ord(c) for c in req["input"]]})
            return
        if not isinstance(req.get("prompt"), str):
            problem = {"loc": ["body", "prompt"], "msg": "Input should be a valid string"}
            self._send(422, {"detail": [problem]})
            return
        pieces, finish = self._completion(req["prompt"], req.get("max_tokens", 16))
        if not req.get("stream"):
            text = "".join(t for t, _ in pieces)
            usage = {"completion_tokens": sum(n for _, n in pieces)}
            choice = {"text": text, "index": 0, "finish_reason": finish}
            self._send(200, {"choices": [choice], "usage": usage})
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b": ping - keep-alive\r\n\r\n")
        for text, finish_reason in [*((t, None) for t, _ in pieces), ("", finish)]:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}
            doc = {"object": "text_completion", "model": "/some/file.gguf", "choices": [choice]}
            self.wfile.write(f"data: {json.dumps(doc)}\r\n\r\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\r\n\r\n")

    @staticmethod
    def _completion(prompt: str, max_tokens: int) -> tuple[list[tuple[str, int]], str]:
        if "short" in prompt:
            return [("A", 1), (" b", 1)], "stop"
        out, n = [], 0
        while n < max_tokens:  # a character begun at the cap is finished, as llama.cpp does
            piece = PIECES[len(out) % len(PIECES)]
            out.append(piece)
            n += piece[1]
        return out, "length"


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
