"""GPU check of the vLLM side of dspark, on one GPU and no network. Run it through check.sh.

Part 1 (extract): `vllm serve TARGET` with the `extract_hidden_states` speculative method and
hs-connectors' Mooncake connector; each prompt's hidden states (our aux layers + the last layer)
are read back from a local Mooncake store and their shapes, token ids and finiteness checked.
Part 2 (dspark): `vllm serve TARGET` with our exported draft (`method: dspark`), driven by our
load client at several concurrencies: tok/s, TTFT p50 and vLLM's acceptance length per cell.

Every wait has a timeout and the whole run a deadline; a failure is one line
(`gpu-check: FAIL ...`). Results: OUT/gpu_check.json plus the servers' logs in OUT.

vLLM facts used below were read in the vllm 0.33.0 wheel (the newest on PyPI); paths and line
numbers are that wheel's. hs-connectors facts are from hs-connectors 0.9.0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dspark.net import free_port  # stdlib only; check.sh puts the working tree on PYTHONPATH

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "gpu-check:"

# hs-connectors 0.9.0, transfer.py:438-461 (MooncakeBackend.build_kv_transfer_config): the
# connector's class name, the module vLLM imports it from, and the extra-config section it reads.
MOONCAKE_CONNECTOR = "MooncakeHiddenStatesConnector"
MOONCAKE_CONNECTOR_MODULE = "hs_connectors.mooncake_hidden_states_connector"
# hs-connectors 0.9.0, mooncake_store.py:115-125: the fields of MooncakeStoreConfig.
MOONCAKE_STORE_FIELDS = (
    "local_hostname",
    "metadata_server",
    "master_server_address",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "device_name",
    "num_writer_threads",
)
GIB = 1024**3

PROMPTS = (
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "A train leaves at 3pm at 60 km/h; another at 4pm at 90 km/h. When does the second catch up?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Translate into French: The weather is lovely today and we are going to the beach.",
    "List five uses of a paperclip.",
    "What is the derivative of x^3 * sin(x)? Show the steps.",
    "Write a short haiku about autumn leaves.",
)


class CheckError(Exception):
    """A failed check: its message is the one line printed."""


# --- the configs and command lines (pure: unit-tested on the CPU, no vLLM needed) --------------


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CheckError(f"cannot read {path}: {e}") from None


def extract_layer_ids(export_cfg: dict, target_cfg: dict) -> list[int]:
    """Capture ids for the extraction: the draft's aux ids plus the last layer.

    vLLM's capture id k is the output of decoder layer k-1 (vllm/model_executor/models/llama.py:440
    appends id idx+1 after layer idx), the same indexing as our export's
    `aux_hidden_state_layer_ids` (dspark/export.py), so id L (= num_hidden_layers) is the last
    layer before the final norm: what our trainer takes as the target's last hidden state.
    """
    num_layers = int(target_cfg["num_hidden_layers"])
    ids = sorted({*(int(i) for i in export_cfg["aux_hidden_state_layer_ids"]), num_layers})
    if ids[0] < 1 or ids[-1] > num_layers:
        raise CheckError(f"aux layer ids {ids} fall outside 1..{num_layers}")
    return ids


def extract_speculative_config(layer_ids: list[int]) -> dict:
    """--speculative-config for hidden-state extraction.

    vllm/config/speculative.py:72 lists "extract_hidden_states" among the methods; :1347-1371
    reads `draft_model_config["hf_config"]` from a plain dict and passes its keys to
    ExtractHiddenStatesConfig, whose `eagle_aux_hidden_state_layer_ids` fixes how many hidden
    states each token stores (vllm/model_executor/models/extract_hidden_states.py:331-333).
    """
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def mooncake_store_config(
    master: str, host: str = "127.0.0.1", global_gib: float = 2.0, buffer_gib: float = 1.0
) -> dict:
    """A MooncakeStoreConfig as a dict (hs-connectors 0.9.0 mooncake_store.py:115-125)."""
    return {
        "local_hostname": host,
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": master,
        "global_segment_size": int(global_gib * GIB),
        "local_buffer_size": int(buffer_gib * GIB),
        "protocol": "tcp",
        "device_name": "",
        "num_writer_threads": 2,
    }


def kv_transfer_config(store: dict) -> dict:
    """--kv-transfer-config loading hs-connectors' Mooncake connector out of tree.

    Keys: vllm/config/kv_transfer.py:60 kv_connector, :71 kv_role, :78
    kv_connector_extra_config, :81 kv_connector_module_path. The connector reads
    `kv_connector_extra_config["mooncake"]` (hs-connectors 0.9.0 transfer.py:454-460).
    """
    return {
        "kv_connector": MOONCAKE_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_module_path": MOONCAKE_CONNECTOR_MODULE,
        "kv_connector_extra_config": {"mooncake": dict(store)},
    }


def dspark_speculative_config(export_dir: Path, export_cfg: dict, k: int | None = None) -> dict:
    """--speculative-config serving our exported draft.

    vllm/config/speculative.py:70 `DSparkModelTypes = Literal["dspark"]`; :413
    num_speculative_tokens, :416 model, :419 method. The speculators config maps onto
    Qwen3DSparkModel (vllm/transformers_utils/configs/speculators/algos.py:152-209). With
    `sample_from_anchor` (our export sets it) every one of the N = num_speculative_tokens block
    slots drafts (vllm/v1/worker/gpu/spec_decode/dspark/speculator.py:49-55), so N is at most
    the trained block size.
    """
    if export_cfg.get("speculators_model_type") != "dspark":
        raise CheckError(f"{export_dir}: speculators_model_type is not 'dspark'")
    block = int(export_cfg["block_size"])
    k = block if k is None else int(k)
    if not 1 <= k <= block:
        raise CheckError(f"num_speculative_tokens {k} is outside 1..{block} (the block size)")
    return {"method": "dspark", "model": str(export_dir), "num_speculative_tokens": k}


def serve_argv(
    python: str,
    target: Path,
    port: int,
    speculative: dict | None,
    kv_transfer: dict | None = None,
    *,
    name: str = "target",
    max_model_len: int = 2048,
    gpu_memory_utilization: float = 0.35,
    eager: bool = False,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """`vllm serve` through its module (the console script may not be on PATH when the wheels
    are installed with --target). Both config flags take JSON (vllm/engine/arg_utils.py:1864-1866
    `--speculative-config`, :1881 `--kv-transfer-config`)."""
    argv = [
        python, "-m", "vllm.entrypoints.cli.main", "serve", str(target),
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", name,
        "--dtype", "bfloat16",
        "--max-model-len", str(max_model_len),
        "--gpu-memory-utilization", str(gpu_memory_utilization),
        "--seed", "0",
        # greedy unless a request says otherwise: the load client sends no temperature
        "--override-generation-config", json.dumps({"temperature": 0.0}),
    ]  # fmt: skip
    if speculative is not None:
        argv += ["--speculative-config", json.dumps(speculative)]
    if kv_transfer is not None:
        # prefix caching would skip cached prompt tokens and their hidden states
        argv += ["--kv-transfer-config", json.dumps(kv_transfer), "--no-enable-prefix-caching"]
    if eager:
        argv.append("--enforce-eager")
    return argv + list(extra)


def expected_hidden_shape(num_tokens: int, layer_ids: list[int], hidden_size: int) -> tuple:
    """[num_tokens, num_hidden_states, hidden_size]: extract_hidden_states.py:360-364 and the
    manifest hs-connectors 0.9.0 builds (mooncake_hidden_states_connector.py:392-414)."""
    return (num_tokens, len(layer_ids), hidden_size)


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')


def parse_prometheus(text: str) -> dict:
    """Counters of vLLM's /metrics summed over label sets; accepted-per-position by position."""
    out: dict = {"per_pos": {}}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        if name.startswith("vllm:spec_decode_num_accepted_tokens_per_pos"):
            pos = _POSITION.search(labels or "")
            if pos:
                out["per_pos"][int(pos.group(1))] = out["per_pos"].get(int(pos.group(1)), 0.0) + v
            continue
        out[name] = out.get(name, 0.0) + v
    return out


def acceptance(before: dict, after: dict) -> dict | None:
    """Acceptance over a cell from counter deltas: the counters of vllm/v1/spec_decode/metrics.py
    :229-231 (exported with a `_total` suffix); mean acceptance length counts the bonus token,
    as vLLM's own log line does."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafts = delta("vllm:spec_decode_num_drafts_total")
    drafted = delta("vllm:spec_decode_num_draft_tokens_total")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    if drafts <= 0:
        return None
    per_pos = {
        p: round((after["per_pos"].get(p, 0.0) - before["per_pos"].get(p, 0.0)) / drafts, 4)
        for p in sorted(after.get("per_pos", {}))
    }
    return {
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_length": round(1 + accepted / drafts, 3),
        "draft_acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "per_position": per_pos,
    }


def generated_tokens(before: dict, after: dict) -> float:
    """Tokens the server generated over a cell (vllm/v1/metrics/loggers.py:799)."""
    key = "vllm:generation_tokens_total"
    return after.get(key, 0.0) - before.get(key, 0.0)


# --- running it (needs a GPU, vLLM, and for part 1 mooncake + hs-connectors) ------------------


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self, cap: float) -> float:
        left = self.end - time.monotonic()
        if left <= 1:
            raise CheckError("out of time (the run's deadline passed)")
        return min(cap, left)


def last_error(log: Path) -> str:
    """The last line of a log that looks like an error, for the one-line message."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if re.search(r"Error|error:|Exception|Traceback|FAIL", line):
            return line.strip()[:300]
    return (lines[-1].strip()[:300]) if lines else ""


class Proc:
    """A server in its own process group, logging to OUT, stopped by group (TERM, then KILL)."""

    def __init__(self, what: str, argv: list[str], log: Path, env: dict | None = None):
        self.what, self.log = what, log
        self.fh = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.fh.write("$ " + " ".join(argv) + "\n")
        self.fh.flush()
        self.p = subprocess.Popen(
            argv, stdout=self.fh, stderr=subprocess.STDOUT, env=env, process_group=0
        )

    def dead(self) -> CheckError | None:
        rc = self.p.poll()
        if rc is None:
            return None
        return CheckError(f"{self.what} exited with code {rc}: {last_error(self.log)}")

    def stop(self) -> None:
        if self.p.poll() is None:
            for sig, wait in ((signal.SIGTERM, 8), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.p.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.fh.close()


def wait_until(probe, proc: Proc, deadline: Deadline, cap: float, what: str) -> float:
    t0 = time.monotonic()
    end = t0 + deadline.left(cap)
    while time.monotonic() < end:
        if (err := proc.dead()) is not None:
            raise err
        if probe():
            return round(time.monotonic() - t0, 1)
        time.sleep(0.5)
    raise CheckError(
        f"{what} not ready after {round(time.monotonic() - t0)} s: {last_error(proc.log)}"
    )


def http_ok(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def scrape(url: str) -> dict:
    import httpx

    return parse_prometheus(httpx.get(f"{url}/metrics", timeout=10.0).text)


def server_env() -> dict:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        MC_LOG_LEVEL=env.get("MC_LOG_LEVEL", "WARNING"),
        MC_TRANSFER_TIMEOUT=env.get("MC_TRANSFER_TIMEOUT", "30"),
    )
    return env


def prompt_ids(target: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    out = []
    for text in (PROMPTS * (n // len(PROMPTS) + 1))[:n]:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def mooncake_master_binary() -> str:
    found = shutil.which("mooncake_master")
    if found:
        return found
    try:
        import mooncake
    except ImportError:
        raise CheckError("mooncake is not importable: carry mooncake-transfer-engine") from None
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.is_file():
        raise CheckError(f"no mooncake_master binary (looked on PATH and in {path.parent})")
    return str(path)


def check_extract(args, deadline: Deadline, out: Path, result: dict) -> None:
    try:
        import torch
        from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
    except ImportError as e:
        raise CheckError(f"hs-connectors is not importable ({e}): carry its wheel") from None
    import httpx

    export_cfg = read_json(args.export / "config.json")
    target_cfg = read_json(args.target / "config.json")
    layer_ids = extract_layer_ids(export_cfg, target_cfg)
    hidden = int(target_cfg["hidden_size"])
    rpc = free_port()
    master_addr = f"127.0.0.1:{rpc}"
    spec = extract_speculative_config(layer_ids)
    kv = kv_transfer_config(mooncake_store_config(master_addr))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    result.update(layer_ids=layer_ids, speculative_config=spec, kv_transfer_config=kv, samples=[])
    procs: list[Proc] = []
    try:
        master = Proc(
            "mooncake_master",
            [
                mooncake_master_binary(),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={rpc}",
                "--enable_http_metadata_server=false",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={free_port()}",
            ],
            out / "mooncake_master.log",
            server_env(),
        )
        procs.append(master)
        wait_until(lambda: port_open(rpc), master, deadline, 15, "mooncake_master")
        argv = serve_argv(sys.executable, args.target, port, spec, kv, eager=True)
        server = Proc("vllm serve (extract)", argv, out / "vllm_extract.log", server_env())
        procs.append(server)
        result["startup_s"] = wait_until(
            lambda: http_ok(f"{url}/health"), server, deadline, args.start_timeout, "vLLM (extract)"
        )
        store = MooncakeHiddenStatesStore(
            MooncakeStoreConfig(
                **mooncake_store_config(master_addr, global_gib=0.25, buffer_gib=0.5)
            )
        )
        store.setup()
        for i, ids in enumerate(prompt_ids(args.target, args.extract_prompts)):
            t0 = time.perf_counter()
            r = httpx.post(
                f"{url}/v1/completions",
                json={"model": "target", "prompt": ids, "max_tokens": 1, "temperature": 0.0},
                timeout=deadline.left(60),
            )
            if r.status_code != 200:
                raise CheckError(f"extract prompt {i}: HTTP {r.status_code}: {r.text[:200]}")
            params = r.json().get("kv_transfer_params")
            if not isinstance(params, dict) or "handle" not in params:
                raise CheckError(f"extract prompt {i}: no kv_transfer_params manifest in the reply")
            got = store.get_sample(params, timeout=deadline.left(30))
            hs, toks = got["hidden_states"], got["token_ids"]
            want = expected_hidden_shape(len(ids), layer_ids, hidden)
            sample = {
                "prompt_tokens": len(ids),
                "shape": list(hs.shape),
                "dtype": str(hs.dtype),
                "finite": bool(torch.isfinite(hs.float()).all()),
                "token_ids_match": toks.tolist() == ids,
                "seconds": round(time.perf_counter() - t0, 3),
            }
            result["samples"].append(sample)
            store.delete_sample(params["handle"])
            if tuple(hs.shape) != want:
                raise CheckError(
                    f"extract prompt {i}: hidden states {list(hs.shape)}, want {list(want)}"
                )
            if not sample["token_ids_match"]:
                raise CheckError(f"extract prompt {i}: token ids differ from the prompt")
            if not sample["finite"]:
                raise CheckError(f"extract prompt {i}: hidden states hold NaN or inf")
        result["ok"] = True
    finally:
        for p in reversed(procs):
            p.stop()


def check_dspark(args, deadline: Deadline, out: Path, result: dict) -> None:
    from dspark.serve.client import closed_loop, summarize

    export_cfg = read_json(args.export / "config.json")
    spec = dspark_speculative_config(args.export, export_cfg, args.k)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    result.update(speculative_config=spec, cells=[])
    argv = serve_argv(sys.executable, args.target, port, spec, eager=args.eager)
    server = Proc("vllm serve (dspark)", argv, out / "vllm_dspark.log", server_env())
    try:
        result["startup_s"] = wait_until(
            lambda: http_ok(f"{url}/health"), server, deadline, args.start_timeout, "vLLM (dspark)"
        )
        reqs = [{"id": i, "prompt": p} for i, p in enumerate(prompt_ids(args.target, 8))]

        def cell(c: int, n: int, max_tokens: int, cap: float) -> dict:
            return asyncio.run(
                closed_loop(url, reqs, c, n, deadline.left(cap), max_tokens, "target")
            )

        cell(1, 1, 16, 60)  # warm-up
        for c in args.concurrency:
            before = scrape(url)
            raw = cell(c, max(4, 2 * c), args.max_tokens, args.cell_seconds)
            after = scrape(url)
            s = summarize(raw)
            gen = generated_tokens(before, after)
            row = {
                "concurrency": c,
                "requests": s["requests"],
                "errors": s["errors"],
                # the client counts a streamed chunk as one token; under speculative decoding a
                # chunk carries several, so tok/s comes from the server's own counter
                "tok_s": round(gen / raw["wall_s"], 1) if raw["wall_s"] > 0 else None,
                "generated_tokens": gen,
                "wall_s": s["wall_s"],
                "ttft_p50_ms": s["ttft_p50_ms"],
                "ttft_p99_ms": s["ttft_p99_ms"],
                "acceptance": acceptance(before, after),
            }
            result["cells"].append(row)
            if s["errors"]:
                first = next(r["error"] for r in raw["records"] if "error" in r)
                raise CheckError(f"dspark c={c}: {s['errors']} request(s) failed: {first[:200]}")
            if row["acceptance"] is None:
                raise CheckError(f"dspark c={c}: vLLM's /metrics shows no speculative drafts")
        result["ok"] = True
    finally:
        server.stop()


def table(cells: list[dict]) -> str:
    lines = [f"{'conc':>4} {'tok/s':>9} {'TTFT p50 ms':>12} {'accept len':>10} {'errors':>6}"]
    for c in cells:
        acc = (c.get("acceptance") or {}).get("acceptance_length")
        lines.append(
            f"{c['concurrency']:>4} {c['tok_s'] if c['tok_s'] is not None else '-':>9} "
            f"{c['ttft_p50_ms'] if c['ttft_p50_ms'] is not None else '-':>12} "
            f"{acc if acc is not None else '-':>10} {c['errors']:>6}"
        )
    return "\n".join(lines)


def preflight(args) -> dict:
    for what, folder, files in (
        ("target", args.target, ("config.json",)),
        ("draft", args.export, ("config.json", "model.safetensors")),
    ):
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise CheckError(f"{what} folder {folder} lacks {', '.join(missing)} (carry it)")
    if not list(args.target.glob("*.safetensors")):
        raise CheckError(f"target folder {args.target} holds no *.safetensors (carry it)")
    import torch

    if not torch.cuda.is_available():
        raise CheckError("torch sees no CUDA device")
    import vllm

    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "vllm": getattr(vllm, "__version__", "?")}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "dspark-gpu-check"
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", tmp)))
    ap.add_argument("--target", type=Path, default=ROOT / "artifacts/target")
    ap.add_argument("--export", type=Path, default=ROOT / "artifacts/export/dspark")
    ap.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: block)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--extract-prompts", type=int, default=4)
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--cell-seconds", type=float, default=40.0)
    ap.add_argument("--eager", action="store_true", help="part 2 without CUDA graphs")
    ap.add_argument("--skip", choices=("extract", "dspark"), action="append", default=[])
    args = ap.parse_args(argv)
    args.target, args.export = args.target.resolve(), args.export.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = Deadline(args.budget)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"ok": False, "errors": {}}
    try:
        report["env"] = preflight(args)
    except (CheckError, ImportError) as e:
        print(f"{PREFIX} FAIL preflight: {e}", flush=True)
        report["errors"]["preflight"] = str(e)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        return 2
    print(f"{PREFIX} {report['env']}", flush=True)
    parts = [("extract", check_extract), ("dspark", check_dspark)]
    for name, run in parts:
        if name in args.skip:
            continue
        t0 = time.monotonic()
        try:
            run(args, deadline, args.out, report.setdefault(name, {"ok": False}))
            print(f"{PREFIX} PASS {name} ({time.monotonic() - t0:.0f} s)", flush=True)
        except Exception as e:  # one line per failure, the rest goes on
            msg = str(e) if isinstance(e, CheckError) else f"{type(e).__name__}: {e}"
            report["errors"][name] = msg
            print(f"{PREFIX} FAIL {name}: {msg}", flush=True)
    if cells := report.get("dspark", {}).get("cells"):
        print(table(cells), flush=True)
    report["ok"] = not report["errors"]
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout` -> finally stops servers
    sys.exit(main())
