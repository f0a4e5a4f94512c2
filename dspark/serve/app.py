"""An OpenAI-compatible completions endpoint over the serving engine, so one load client drives
our engine here and vLLM elsewhere.

    POST /v1/completions   prompt (text, or token ids as vLLM takes them), max_tokens,
                           temperature / top_p (must match the server's: sampling is per
                           server), stream (server-sent events, ending `data: [DONE]`)
    GET  /v1/models        the one model served
    GET  /health           ready once the engine is (the verify cost is profiled at start)
    GET  /v1/dspark/stats  the engine's totals: steps, and a step's time split into drafting,
                           verification, accepting and scheduling (`EngineStats`); for a mode
                           the cost model plans, the verify cost profiled at start and the
                           scheduler's state: does drafting pay, the drafting overhead, the
                           survival curve, the acceptance measured per slot (`acceptance`:
                           decayed trials, rate, and a head's calibration ratio)

Beyond OpenAI's fields, each choice carries `token_ids` (the tokens in this chunk, as vLLM's
`return_token_ids` gives them) and the final response a `dspark` object (verify steps, drafts
proposed and accepted), from which the load client measures acceptance. Malformed requests get a
400 in OpenAI's error shape naming the field.

Fields this server does not know (`user`, `presence_penalty`, ...) are accepted, as vLLM accepts
them, and named: the final response's `dspark.ignored` lists them, so a client learns that its
setting had no effect. A known field that would change the answer and is not implemented (`n`,
`echo`, `logprobs`, `stop`, another temperature) is refused with a 400 instead.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from dspark.decode.sampling import Sampling
from dspark.serve.engine import Request, ServeEngine


class CompletionRequest(BaseModel):
    # Clients send fields we have no use for (user, presence_penalty, ...): accept those and
    # name them in the response (`ignored`), but refuse the ones that would change the answer
    # and that we do not implement.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    n: int = 1
    echo: bool = False
    logprobs: int | None = None
    stop: str | list[str] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for a field set to something this server does not do."""
        if self.n != 1:
            return "n", "one completion per request"
        if self.echo:
            return "echo", "the prompt is not echoed"
        if self.logprobs is not None:
            return "logprobs", "log probabilities are not returned"
        if self.stop:
            return "stop", "no stop sequences (EOS and max_tokens end a completion)"
        return None

    @property
    def ignored(self) -> list[str]:
        """The request's fields this server does not know, sorted."""
        return sorted(self.model_extra or {})


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"message": message, "type": kind, "param": param, "code": None}
    return JSONResponse({"error": body}, status_code=status)


class _Stream:
    """Hands the engine thread's callbacks to the request's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def __call__(self, tokens: list[int], finish: str | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (tokens, finish))


class Detokenizer:
    """Text deltas from a growing token list; holds back a trailing partial UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def add(self, tokens: list[int], final: bool) -> str:
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


def create_app(
    engine: ServeEngine, tokenizer, model_name: str, mode: str, verify_cost: dict | None = None
) -> FastAPI:
    """`verify_cost`: the table a cost-model mode profiled at start, shown in the stats."""
    app = FastAPI(title="dspark", docs_url=None, redoc_url=None)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(HTTPException, _http_error)
    vocab = len(tokenizer)

    @app.get("/health")
    async def health():
        if engine.failure is not None:
            return _error(503, f"the engine stopped: {engine.failure}")
        return {"status": "ok", "mode": mode, "model": model_name}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "owned_by": "dspark"}],
        }

    @app.get("/v1/dspark/stats")
    async def stats():
        doc = {"mode": mode, "busy": engine.busy(), **engine.stats.to_json()}
        if engine.scheduler is not None:
            doc["scheduler"] = engine.scheduler.state()
        return {**doc, "verify_cost": verify_cost} if verify_cost else doc

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if (refused := _refusal(body, engine.sampling, model_name, vocab)) is not None:
            return refused
        ids = _prompt_ids(body.prompt, tokenizer)
        stream = _Stream(asyncio.get_running_loop())
        try:
            req = engine.submit(ids, body.max_tokens, stream)
        except ValueError as e:
            return _error(400, str(e), "prompt")
        except RuntimeError as e:
            return _error(503, str(e))
        completion = _Completion(model_name, mode, body, len(ids), req)
        detok = Detokenizer(tokenizer)
        if not body.stream:
            return await _whole_completion(engine, stream, completion, detok)
        events = _completion_events(engine, stream, completion, detok)
        return StreamingResponse(events, media_type="text/event-stream")

    return app


async def _invalid_request(_request, exc: RequestValidationError) -> JSONResponse:
    """A malformed request's 400, naming the first field at fault, in OpenAI's error shape."""
    e = exc.errors()[0]
    if e["type"] == "json_invalid":
        return _error(400, f"body: not valid JSON ({e.get('ctx', {}).get('error', '')})")
    where = ".".join(str(p) for p in e["loc"] if p != "body") or "body"
    return _error(400, f"{where}: {e['msg']}", where)


async def _http_error(_request, exc: HTTPException) -> JSONResponse:
    return _error(exc.status_code, str(exc.detail))


def _refusal(
    body: CompletionRequest, want: Sampling, model_name: str, vocab: int
) -> JSONResponse | None:
    """The error answer to a request this server would not answer as asked, or None."""
    if body.model is not None and body.model != model_name:
        return _error(404, f"model: this server serves {model_name!r}, not {body.model!r}")
    if (bad := body.unsupported()) is not None:
        return _error(400, f"{bad[0]}: not supported: {bad[1]}", bad[0])
    if body.temperature is not None and body.temperature != want.temperature:
        return _error(
            400,
            f"temperature: this server samples at {want.temperature} (per-request "
            "sampling is not supported; omit the field)",
            "temperature",
        )
    if body.top_p is not None and body.top_p != want.top_p:
        return _error(400, f"top_p: this server uses {want.top_p}; omit the field", "top_p")
    if not isinstance(body.prompt, str):
        bad = next((t for t in body.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            return _error(400, f"prompt: token id {bad} is outside [0, {vocab})", "prompt")
    return None


def _prompt_ids(prompt: str | list[int], tokenizer) -> list[int]:
    """Token ids as the client sent them, or its text tokenized without special tokens."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return prompt


@dataclass
class _Completion:
    """One request's response documents: every chunk of it carries the same id and time."""

    model_name: str
    mode: str
    body: CompletionRequest
    prompt_tokens: int
    req: Request
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, text: str, tokens: list[int], finish: str | None) -> dict:
        """A response, or a streamed chunk of one; the last (`finish` set) adds the totals."""
        choice = {
            "index": 0,
            "text": text,
            "token_ids": tokens,
            "logprobs": None,
            "finish_reason": _openai_finish(finish),
        }
        doc = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": [choice],
        }
        if finish is not None:
            doc["usage"] = self.usage()
            doc["dspark"] = self.dspark_totals(finish)
        return doc

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.req.tokens),
            "total_tokens": self.prompt_tokens + len(self.req.tokens),
        }

    def dspark_totals(self, finish: str) -> dict:
        req = self.req
        return {
            "mode": self.mode,
            "steps": req.steps,
            "proposed": req.proposed,
            "accepted": req.accepted,
            "finish": finish,
            "ignored": self.body.ignored,
        }


async def _whole_completion(
    engine: ServeEngine, stream: _Stream, completion: _Completion, detok: Detokenizer
) -> dict | JSONResponse:
    """The response once generation ends, or a 500 if it ended in an error."""
    req = completion.req
    try:
        while True:
            _tokens, finish = await stream.queue.get()
            if finish is not None:
                break
    finally:  # cancelled while waiting (server shutdown): free the row
        if not req.done:
            engine.cancel(req)
    if finish in ("error", "cancelled"):
        return _error(500, f"generation ended: {finish}")
    return completion.chunk(detok.add(req.tokens, final=True), list(req.tokens), finish)


async def _completion_events(
    engine: ServeEngine, stream: _Stream, completion: _Completion, detok: Detokenizer
):
    """Server-sent events: a chunk per engine callback, then `data: [DONE]`."""
    req = completion.req
    try:
        while True:
            tokens, finish = await stream.queue.get()
            if finish in ("error", "cancelled"):
                err = {"message": f"generation ended: {finish}", "type": "server_error"}
                yield f"data: {json.dumps({'error': err})}\n\n"
                break
            text = detok.add(tokens, final=finish is not None)
            yield f"data: {json.dumps(completion.chunk(text, tokens, finish))}\n\n"
            if finish is not None:
                break
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or we are done): free the row
        if not req.done:
            engine.cancel(req)


def _openai_finish(finish: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(finish or "")
