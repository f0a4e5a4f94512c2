"""The load client: c closed-loop clients streaming completions from an OpenAI-compatible server
(ours, or vLLM's), each sending its next request as soon as its last one ends, until the cell's
request count or time is spent. It runs as its own process so its work never shares the
server's interpreter:

    python -m dspark.serve.client --url http://127.0.0.1:8000 --requests reqs.json \\
        --concurrency 4 --max-requests 8 --max-tokens 64 --out cell.json

`reqs.json` is a list of {"id": ..., "prompt": [token ids]}; requests go out in that order,
cycling. Each asks for the token ids of every chunk (`return_token_ids`, which vLLM needs and our
endpoint always does) and the usage (`stream_options`: vLLM then sends it in a last chunk with
no choices). `--temperature`/`--top-p` go in every request: vLLM samples per request (default
temperature 1), our endpoint refuses values other than its own. `--extra` adds fields to every
request (a server's own sampling defaults turned off), `--prompt-text` sends each request's
`text` (its prompt decoded) for a server that takes no token ids (llama.cpp's). The output has
one record per request (arrival times of every streamed chunk and the tokens in it) and the
cell's wall time; `summarize` turns that into the benchmark's figures.

Counting tokens. Our endpoint and vLLM name the token ids of every chunk. llama.cpp's server
(llama-cpp-python) names none and sends no usage: it streams a chunk per generated token, except
that tokens which only together make a character (a multi-byte character split over byte
tokens) go out as one chunk, and it does not stream the EOS. So, for a stream without ids
(`untokenized_count`): a chunk is one token; a finish `stop` (only the EOS ends a completion
there: no stop sequences are sent) adds the EOS, as our endpoint streams and counts it; a finish
`length` counts max_tokens, what was asked and what our engine generates, so a shortfall (tokens
sent together as one character) is added at that last arrival. Two counts are not exact: a
completion ending in EOS with such characters counts short, and where the cap falls inside such
a character llama.cpp generates up to 3 tokens more to finish it, which are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path

import httpx

from dspark.io import write_json


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    req: dict,
    max_tokens: int,
    model: str | None,
    sampling: dict | None = None,
    prompt_text: bool = False,
) -> dict:
    body = {
        "prompt": req["text"] if prompt_text else req["prompt"],
        "max_tokens": max_tokens,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        **(sampling or {}),
    }
    if model:
        body["model"] = model
    rec = {"id": req["id"], "prompt_tokens": len(req["prompt"]), "chunks": [], "tokens": []}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                rec["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
                return rec
            async for t, data in _events(r, t0):
                if data == "[DONE]":
                    break
                doc = json.loads(data)
                if "error" in doc:
                    rec["error"] = doc["error"].get("message", "error")
                    break
                if doc.get("usage"):
                    rec["completion_tokens"] = doc["usage"].get("completion_tokens")
                if not doc.get("choices"):  # vLLM's usage chunk
                    continue
                choice = doc["choices"][0]
                ids = choice.get("token_ids")
                if ids is None:  # a server that names no tokens: llama.cpp's
                    counted = sum(n for _, n in rec["chunks"])
                    n = untokenized_count(choice.get("finish_reason"), counted, max_tokens)
                else:
                    n = len(ids)
                if n:  # a chunk of no token (a finish reason alone) is no arrival
                    rec["chunks"].append([t, n])
                rec["tokens"].extend(ids or [])
                if choice.get("finish_reason"):
                    rec["finish"] = choice["finish_reason"]
                if "dspark" in doc:
                    rec.update({k: doc["dspark"][k] for k in ("steps", "proposed", "accepted")})
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["latency_s"] = time.perf_counter() - t0
    return rec


def untokenized_count(finish: str | None, counted: int, max_tokens: int) -> int:
    """Tokens in a chunk of a stream that names none (llama.cpp's), given the finish reason
    the chunk carries and the tokens counted before it (module docstring, Counting tokens)."""
    if finish is None:
        return 1
    if finish == "stop":
        return 1  # the EOS, generated and not streamed
    if finish == "length":  # max_tokens: tokens streamed together as one character are owed
        return max(0, max_tokens - counted)
    return 0


async def _events(response: httpx.Response, t0: float):
    """(arrival time, data) of each server-sent event, the time being that of the socket read
    that completed it: events that one read delivers share one time stamp, so `summarize` can
    tell a burst the client read at once from tokens that arrived apart."""
    pending = ""
    async for text in response.aiter_text():
        t = time.perf_counter() - t0
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            line = line.rstrip("\r")
            if line.startswith("data: "):
                yield t, line[len("data: ") :]
    if pending.startswith("data: "):  # a last event without its line end
        yield time.perf_counter() - t0, pending.rstrip("\r")[len("data: ") :]


async def closed_loop(
    url: str,
    requests: list[dict],
    concurrency: int,
    max_requests: int,
    max_seconds: float,
    max_tokens: int,
    model: str | None = None,
    sampling: dict | None = None,
    prompt_text: bool = False,
) -> dict:
    issued = 0
    records: list[dict] = []
    start = time.perf_counter()

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal issued
        while issued < max_requests and time.perf_counter() - start < max_seconds:
            req = requests[issued % len(requests)]
            issued += 1
            records.append(
                await one_request(client, url, req, max_tokens, model, sampling, prompt_text)
            )

    limits = httpx.Limits(max_connections=concurrency + 1)
    timeout = httpx.Timeout(None, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return {
        "concurrency": concurrency,
        "wall_s": time.perf_counter() - start,
        "records": records,
    }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def _arrivals(chunks: list[list]) -> list[list]:
    """[time, tokens] with the chunks of one read (one time stamp) merged."""
    out: list[list] = []
    for t, n in chunks:
        if out and out[-1][0] == t:
            out[-1][1] += n
        else:
            out.append([t, n])
    return out


def summarize(cell: dict) -> dict:
    """Per-cell figures: aggregate and per-request tok/s, TTFT and inter-token latency (p50,
    p99, ms), tau, distinct-2. The chunks one socket read delivered are one arrival, and an
    arrival of n tokens after a gap g counts as n gaps of g/n: a client that reads a backlog at
    once did not see those tokens 0 ms apart."""
    from dspark.evaluate.summary import distinct_n  # torch: not for the client process

    ok = [r for r in cell["records"] if "error" not in r and r["chunks"]]
    tokens = sum(sum(n for _, n in r["chunks"]) for r in ok)
    ttft = [r["chunks"][0][0] * 1000 for r in ok]
    itl = []
    for r in ok:
        for (t_prev, _), (t, n) in pairwise(_arrivals(r["chunks"])):
            itl.extend([(t - t_prev) * 1000 / n] * n)
    per_request = [
        sum(n for _, n in r["chunks"]) / r["latency_s"] for r in ok if r["latency_s"] > 0
    ]
    steps = sum(r.get("steps") or 0 for r in ok)
    after_first = sum(sum(n for _, n in r["chunks"]) - 1 for r in ok if r.get("steps"))
    distinct = [distinct_n(r["tokens"]) for r in ok if len(r["tokens"]) > 1]

    def rnd(x, nd=2):
        return None if x is None else round(x, nd)

    return {
        "requests": len(cell["records"]),
        "errors": len(cell["records"]) - len(ok),
        "tokens": tokens,
        "wall_s": rnd(cell["wall_s"], 3),
        "tok_s": rnd(tokens / cell["wall_s"] if cell["wall_s"] > 0 else None),
        "request_tok_s": rnd(statistics.median(per_request) if per_request else None),
        "ttft_p50_ms": rnd(_pct(ttft, 50), 1),
        "ttft_p99_ms": rnd(_pct(ttft, 99), 1),
        "itl_p50_ms": rnd(_pct(itl, 50)),
        "itl_p99_ms": rnd(_pct(itl, 99)),
        "tau": rnd(after_first / steps if steps else None, 3),
        "distinct_2": rnd(statistics.mean(distinct) if distinct else None, 4),
        "prompt_ids": [r["id"] for r in ok if "id" in r],  # served, in order, repeats kept
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--requests", required=True, type=Path)
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--max-requests", type=int, required=True)
    ap.add_argument("--max-seconds", type=float, default=600.0)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--temperature", type=float, default=None, help="sent in every request")
    ap.add_argument("--top-p", type=float, default=None, help="sent in every request")
    ap.add_argument("--extra", type=json.loads, default=None, help="JSON fields for every request")
    ap.add_argument(
        "--prompt-text", action="store_true", help="send each request's `text`, not its token ids"
    )
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    try:
        requests = json.loads(args.requests.read_text())
        if not requests or not all("prompt" in r and "id" in r for r in requests):
            raise ValueError("need a non-empty list of {id, prompt}")
        if args.prompt_text and not all(isinstance(r.get("text"), str) for r in requests):
            raise ValueError("--prompt-text: every request needs a `text`")
    except (OSError, ValueError) as e:
        print(f"error: {args.requests}: {e}", file=sys.stderr)
        return 2
    if args.concurrency < 1 or args.max_requests < 1 or args.max_tokens < 1:
        print(
            "error: --concurrency, --max-requests and --max-tokens must be positive",
            file=sys.stderr,
        )
        return 2
    cell = asyncio.run(
        closed_loop(
            args.url,
            requests,
            args.concurrency,
            args.max_requests,
            args.max_seconds,
            args.max_tokens,
            args.model,
            {
                **(args.extra or {}),
                **{
                    k: v
                    for k, v in (("temperature", args.temperature), ("top_p", args.top_p))
                    if v is not None
                },
            },
            args.prompt_text,
        )
    )
    write_json(args.out, cell)
    return 0


if __name__ == "__main__":
    sys.exit(main())
