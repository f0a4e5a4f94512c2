"""CLI benchmark: the wall time of `dspark --help` in a fresh process, over repeated runs.

    python -m benchmarks.cli [--runs 20] [--warmup 2] [--out metrics/studies/cli.json]

What a user waits for at the prompt: the interpreter, the `dspark` entry point, argparse. The
suite checks what keeps it fast (no heavy import on the `--help` path, tests/integration/
test_cli.py); this measures it, beside a bare interpreter start for scale, alternating the two
so the machine's load hits both alike. Figures are min/median/max; read them on an idle
machine. Also lists the slowest imports on the path (`-X importtime`). Prints a table and
writes metrics/studies/cli.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dspark.config import load_params
from dspark.metrics import cpu_features, write_metrics

ROOT = Path(__file__).resolve().parents[1]
ENTRY = Path(sys.executable).parent / "dspark"  # the console script a user runs


def help_command() -> list[str]:
    return [str(ENTRY), "--help"] if ENTRY.is_file() else [sys.executable, "-m", "dspark", "--help"]


def wall_s(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def slowest_imports(n: int = 6) -> list[dict]:
    """The packages whose modules take the most import time on the `--help` path (self time,
    summed per top-level package)."""
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "dspark", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    per_package: dict[str, int] = {}
    for line in res.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        own, _, name = line.removeprefix("import time:").split("|")
        package = name.strip().split(".")[0]
        per_package[package] = per_package.get(package, 0) + int(own)
    top = sorted(per_package.items(), key=lambda kv: -kv[1])[:n]
    return [{"package": k, "self_ms": round(us / 1000, 1)} for k, us in top]


def summary(times: list[float]) -> dict:
    return {
        "min_s": round(min(times), 4),
        "median_s": round(statistics.median(times), 4),
        "max_s": round(max(times), 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured runs (page cache, .pyc)")
    ap.add_argument("--out", type=Path, default=ROOT / "metrics" / "studies" / "cli.json")
    args = ap.parse_args(argv)

    commands = {"dspark --help": help_command(), "python -c pass": [sys.executable, "-c", "pass"]}
    for _ in range(args.warmup):
        for cmd in commands.values():
            wall_s(cmd)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.runs):  # A B A B: the machine's noise hits both alike
        for name, cmd in commands.items():
            times[name].append(wall_s(cmd))

    doc = {
        "command": " ".join(commands["dspark --help"]),
        "runs": args.runs,
        **{k: summary(v) for k, v in zip(("help", "interpreter"), times.values(), strict=True)},
        "help_over_interpreter_s": round(
            statistics.median(times["dspark --help"]) - statistics.median(times["python -c pass"]),
            4,
        ),
        "slowest_imports": slowest_imports(),
        "cpu": cpu_features(),
        "cpus": os.cpu_count(),
        "load_1min": round(os.getloadavg()[0], 2),
    }
    write_metrics(args.out, load_params(ROOT / "params.yaml").profile, doc)
    print(f"{'command':<16} {'min s':>8} {'median s':>9} {'max s':>8}  ({args.runs} runs)")
    for name, ts in times.items():
        s = summary(ts)
        print(f"{name:<16} {s['min_s']:>8.3f} {s['median_s']:>9.3f} {s['max_s']:>8.3f}")
    print(
        "slowest imports: "
        + ", ".join(f"{r['package']} {r['self_ms']:.0f} ms" for r in doc["slowest_imports"])
    )
    print(f"load average {doc['load_1min']} on {doc['cpus']} CPUs; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
