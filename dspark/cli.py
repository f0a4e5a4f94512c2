"""`dspark`: validate params, run one stage or the whole chain, serve the Prefect deployment.

Imports are lazy so `dspark --help` stays fast. Bad input prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--profile", help="profile to run (default: the file's `profile:`)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a dotted params key, e.g. --set prepare.num_samples=8",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    from dspark.stages import STAGES

    parser = argparse.ArgumentParser(prog="dspark", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    v = sub.add_parser("validate", help="validate a params file (every profile)")
    v.add_argument("file", nargs="?", default="params.yaml")
    v.add_argument("--profile", help="also resolve this profile")

    for stage in STAGES:
        p = sub.add_parser(stage.name, help=stage.help)
        _common(p)
        if stage.name in ("prepare", "evaluate", "benchmark"):
            p.add_argument(
                "--prompts",
                type=Path,
                metavar="FILE",
                help="evaluation prompts from a JSONL file instead of the packages",
            )

    r = sub.add_parser("run", help="the whole chain, in process (no Prefect, no DVC)")
    _common(r)
    r.add_argument("--prompts", type=Path, metavar="FILE", help="evaluation prompts (JSONL)")

    s = sub.add_parser(
        "serve", help="create the Prefect work pool and deployment dspark/full, then run a worker"
    )
    s.add_argument("--pool", default="dspark", help="work pool name")

    e = sub.add_parser(
        "endpoint", help="serve the target (and a draft) on an OpenAI-compatible HTTP endpoint"
    )
    _common(e)
    e.add_argument(
        "--mode", required=True, help="none, ngram, eagle3, dspark_fixed, dspark_adaptive"
    )
    e.add_argument("--host", help="bind address (default: serve.host, loopback)")
    e.add_argument("--port", type=int, help="port (default: serve.port)")
    e.add_argument("--resolved", type=Path, help=argparse.SUPPRESS)  # the benchmark's params

    d = sub.add_parser("dvc-yaml", help="write dvc.yaml from the stage registry")
    d.add_argument("--check", action="store_true", help="exit 1 if dvc.yaml is out of date")
    return parser


def _load(args: argparse.Namespace):
    from dspark.config import load_params

    return load_params(args.params, profile=args.profile, overrides=args.overrides)


def _run_stages(args: argparse.Namespace, names: list[str]) -> None:
    from dspark import stages

    params = _load(args)
    root = Path.cwd()
    ctx = stages.StageContext(
        params=params,
        root=root,
        progress=not args.no_progress,
        prompts_file=getattr(args, "prompts", None),
    )
    for name in names:
        doc = stages.run_stage(stages.get(name), ctx)
        print(f"{name}: done in {doc['wall_s']} s -> {stages.get(name).metrics}", file=sys.stderr)
    if len(names) > 1:
        stages.write_run_summary(root, params.profile)


def _endpoint(args: argparse.Namespace) -> int:
    from dspark import stages
    from dspark.config import Params
    from dspark.errors import ConfigError
    from dspark.serve.server import serve

    if args.resolved:  # exactly the params the benchmark stage resolved, overrides and all
        import json

        try:
            params = Params.model_validate(json.loads(args.resolved.read_text()))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{args.resolved}: {str(e).splitlines()[0]}") from None
    else:
        params = _load(args)
    root = Path.cwd()
    host = args.host or params.serve.host
    port = params.serve.port if args.port is None else args.port
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port: {port} is not a port (1..65535)")
    serve(params, root / stages.TARGET_DIR, root / stages.DRAFTS, args.mode, host, port)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dspark.errors import DsparkError

    try:
        if args.command == "validate":
            from dspark.config import load_params, profile_names

            params = load_params(args.file, profile=args.profile)
            print(
                f"{args.file}: ok (profiles: {', '.join(profile_names(args.file))}; "
                f"active: {params.profile})"
            )
        elif args.command == "run":
            from dspark.stages import STAGES

            _run_stages(args, [s.name for s in STAGES])
        elif args.command == "serve":
            # Prefect lives at the edge: the library only starts its process.
            env = {**os.environ, "DSPARK_POOL": args.pool}
            return subprocess.call([sys.executable, "-m", "flows.serve"], env=env)
        elif args.command == "endpoint":
            return _endpoint(args)
        elif args.command == "dvc-yaml":
            from dspark.io import write_text
            from dspark.stages import dvc_yaml

            text = dvc_yaml()
            if args.check:
                current = Path("dvc.yaml").read_text() if Path("dvc.yaml").exists() else ""
                if current != text:
                    print(
                        "dvc.yaml: out of date with dspark/stages.py (run `dspark dvc-yaml`)",
                        file=sys.stderr,
                    )
                    return 1
            else:
                write_text(Path("dvc.yaml"), text)
        else:
            _run_stages(args, [args.command])
    except DsparkError as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
