"""The benchmark's peer modes: llama.cpp (llama-cpp-python's OpenAI server) on the same fp32
weights as our target, driven by the same load client in the same cells as our modes.

    llamacpp          plain decoding
    llamacpp_lookup   with llama.cpp's prompt-lookup draft, benchmark.llamacpp_lookup_k tokens

They need `make llamacpp-venv` (`make run` builds it) and a target made from a packaged GGUF
(`target.model: pkg:<package>`): dspark/servers/llamacpp.py makes the F32 GGUF and runs the
server. The client sends each request's prompt as text (the server takes no token ids), greedy
as ours: serve.temperature and serve.top_p, with llama.cpp's own defaults that would change the
answer turned off (its repeat penalty, top-k and min-p). Its cells have no tau (the server
reports no verify steps) and no step costs; it serves one request at a time, so above
concurrency 1 its throughput is its single stream's.

`ratios` puts the peer beside ours in bench.json (`vs_llamacpp`): per cell, our `none` and our
best mode over llama.cpp plain, and llama.cpp's lookup over its plain, each the median over
rounds of same-round ratios (rounds.paired_ratio).
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.config import Params
from dspark.serve.rounds import paired_ratio, per_round
from dspark.servers.llamacpp import (
    OWN_DEFAULTS_OFF,
    SERVED_NAME,
    LlamacppServer,
    default_venv,
    f32_gguf,
)
from dspark.servers.process import READY_TIMEOUT_S

PLAIN, LOOKUP = "llamacpp", "llamacpp_lookup"
MODES = (PLAIN, LOOKUP)


class LlamacppEndpoint:
    """Shaped like endpoints.EndpointProcess: started on construction (after making the F32
    GGUF, once), then `wait_ready`, `stats`, `stop`; a context manager."""

    def __init__(
        self, mode: str, params: Params, target_dir: Path, root: Path, host: str, log: Path
    ):
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {MODES}")
        s, venv = params.serve, default_venv(root)
        threads = params.provision.threads
        self.mode, self.log = mode, log
        self.server = LlamacppServer(
            f32_gguf(target_dir, venv, threads),
            venv=venv,
            host=host,
            n_ctx=s.max_len,
            threads=threads,
            seed=s.seed,
            lookup_k=params.benchmark.llamacpp_lookup_k if mode == LOOKUP else None,
            log=log,
        ).start()
        self.url = self.server.url
        self.client_args = ["--model", SERVED_NAME, "--prompt-text"]
        self.client_args += ["--temperature", str(s.temperature), "--top-p", str(s.top_p)]
        self.client_args += ["--extra", json.dumps(OWN_DEFAULTS_OFF)]

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        self.server.wait_ready(timeout)

    def stats(self) -> dict:
        return {"steps": 0, "draft_s": 0.0, "verify_s": 0.0}

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> LlamacppEndpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def ratios(cells: list[dict], ours: tuple[str, ...]) -> list[dict]:
    """Per (concurrency, workload) with a llama.cpp plain cell: `none_over_llamacpp` (our
    `none`), `best_mode` (ours with the most tok/s there, `none` included) and
    `best_over_llamacpp`, and `lookup_over_plain`: each a median of same-round ratios."""
    out = []
    by_key: dict[tuple, dict[str, dict]] = {}
    for x in cells:
        by_key.setdefault((x["concurrency"], x["workload"]), {})[x["mode"]] = x
    for (c, w), modes in sorted(by_key.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        peer = modes.get(PLAIN)
        if peer is None:
            continue
        theirs = per_round(peer)
        mine = [m for m in ours if m in modes and modes[m].get("tok_s") is not None]
        best = max(mine, key=lambda m: modes[m]["tok_s"], default=None)
        lookup = modes.get(LOOKUP)
        row = {
            "concurrency": c,
            "workload": w,
            "llamacpp_tok_s": peer.get("tok_s"),
            "none_over_llamacpp": paired_ratio(per_round(modes.get("none")), theirs),
            "best_mode": best,
            "best_over_llamacpp": paired_ratio(per_round(modes.get(best)), theirs),
            "lookup_over_plain": paired_ratio(per_round(lookup), theirs),
        }
        out.append(row)
    return out
