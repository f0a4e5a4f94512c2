"""`dspark endpoint --mode MODE`: the serving engine behind the OpenAI-compatible app, on
uvicorn. Startup loads the target (and the draft the mode needs), profiles the verify cost for
the modes the cost model plans (`dspark_adaptive`, and with `serve.cost_model` every other
speculative mode but `dspark_fixed`), then binds; /health answers once all of that is done.

The benchmark starts its endpoints as
    python -m dspark.serve.server RESOLVED.json MODE HOST PORT TARGET_DIR DRAFTS_DIR
(`main`), with exactly the params the stage resolved, overrides and all."""

from __future__ import annotations

import errno
import json
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from dspark.config import Params, serving_modes
from dspark.decode.decoder import SpecDecoder
from dspark.decode.llama import Llama
from dspark.decode.proposers import Proposer
from dspark.decode.sampling import Sampling
from dspark.drafts import ProposerContext, build_proposer
from dspark.errors import ConfigError, DataError, DsparkError, ResourceError
from dspark.serve.engine import ServeEngine, profile_verify_cost
from dspark.serve.scheduler import AdaptiveScheduler, cost_modelled


@dataclass
class Served:
    engine: ServeEngine
    tokenizer: object
    model_name: str
    mode: str
    cost: dict | None  # the profiled verify cost (the modes the cost model plans)


def profile_counts(max_batch: int, k: int) -> tuple[int, ...]:
    """Token counts to time: powers of two up to the widest step, and the widest itself."""
    widest = max_batch * (k + 1)
    counts = {1, widest}
    n = 2
    while n < widest:
        counts.add(n)
        n *= 2
    return tuple(sorted(counts))


def proposer_for(mode: str, params: Params, target, drafts: Path) -> Proposer:
    """A mode is a method plus how the engine drives it: both DSpark modes serve `dspark`."""
    method = "dspark" if mode.startswith("dspark_") else mode
    return build_proposer(method, ProposerContext.for_serve(params, target, drafts))


def build(params: Params, target_dir: Path, drafts: Path, mode: str) -> Served:
    from dspark.models.target import load_target_for, set_threads

    if mode not in serving_modes():
        raise ConfigError(f"mode: {mode!r} is not one of {', '.join(serving_modes())}")
    cfg = params.serve
    set_threads(params.provision.threads)
    target = load_target_for(params.target, target_dir)
    llama = Llama.from_hf(target.model)
    proposer = proposer_for(mode, params, target, drafts)
    decoder = SpecDecoder(llama, proposer, target.eos_token_id, target.max_context)
    max_len = min(cfg.max_len, target.max_context)
    scheduler, max_drafts, cost = None, None, None
    if mode == "dspark_fixed":
        max_drafts = cfg.dspark_k or proposer.k
        if max_drafts > proposer.k:
            raise ConfigError(
                f"serve.dspark_k: {max_drafts} is above the draft's block {proposer.k}"
            )
    if mode == "dspark_adaptive" and proposer.model.confidence_head is None:
        raise DataError(f"{drafts}/dspark: dspark_adaptive needs a draft with a confidence head")
    if cost_modelled(mode, cfg.cost_model):
        table = profile_verify_cost(
            decoder,
            cfg.max_batch,
            context=max_len // 2,
            counts=profile_counts(cfg.max_batch, proposer.k),
            repeats=cfg.profile_repeats,
        )
        scheduler = AdaptiveScheduler(table, smoothing=cfg.smoothing, decay=cfg.acceptance_decay)
        cost = {"tokens": list(table.tokens), "ms": [round(m, 3) for m in table.ms]}
    engine = ServeEngine(
        decoder,
        cfg.max_batch,
        max_len,
        Sampling(cfg.temperature, cfg.top_p),
        scheduler=scheduler,
        max_drafts=max_drafts,
        seed=cfg.seed,
    )
    return Served(engine, target.tokenizer, target.name, mode, cost)


def claim_port(host: str, port: int) -> socket.socket:
    """Bind the address before minutes of loading: a taken one fails at once, and nobody can
    take ours meanwhile. It listens only once uvicorn starts, so clients are refused until the
    endpoint is ready."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        why = "in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise ConfigError(f"serve.port: {host}:{port} is not available ({why})") from None
    return s


def serve(params: Params, target_dir: Path, drafts: Path, mode: str, host: str, port: int) -> None:
    sock = claim_port(host, port)
    try:
        _run(build(params, target_dir, drafts, mode), sock)
    finally:
        sock.close()


def _run(served: Served, sock: socket.socket) -> None:
    """HTTP on `sock` in a thread of its own while the engine keeps the main thread (torch is
    faster there). A signal stops both; HTTP ending on its own stops the engine and fails."""
    import uvicorn

    from dspark.serve.app import create_app

    app = create_app(served.engine, served.tokenizer, served.model_name, served.mode, served.cost)
    host, port = sock.getsockname()[:2]
    address = f"{host}:{port}"
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)

    def run_http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            served.engine.stop()  # with HTTP gone the engine has nobody to serve

    def on_signal(signum, _frame):
        server.should_exit = True
        served.engine.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    web = threading.Thread(target=run_http, name="dspark-http", daemon=True)
    web.start()
    print(f"dspark endpoint: {served.mode} on http://{address}", flush=True)
    try:
        served.engine.run()
    finally:
        http_failed = not server.should_exit
        server.should_exit = True
        web.join(timeout=30)
    if http_failed:
        raise ResourceError(f"serve: the HTTP server on {address} stopped on its own")


def main(argv: list[str] | None = None) -> int:
    resolved, mode, host, port, target_dir, drafts = sys.argv[1:] if argv is None else argv
    try:
        try:
            params = Params.model_validate(json.loads(Path(resolved).read_text()))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{resolved}: {str(e).splitlines()[0]}") from None
        serve(params, Path(target_dir), Path(drafts), mode, host, int(port))
    except DsparkError as e:
        print(f"dspark endpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
