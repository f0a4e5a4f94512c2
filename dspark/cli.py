"""`dspark`: validate params, run one stage or the whole chain, serve the Prefect deployment.

Imports are lazy so `dspark --help` stays fast. Bad input prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import os
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
    p.add_argument(
        "--spec",
        type=Path,
        metavar="FILE",
        help="cluster spec (infra/*.yaml), same as --set provision.spec=FILE",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    from dspark.config import serving_modes
    from dspark.pipeline import STAGES

    parser = argparse.ArgumentParser(prog="dspark", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    v = sub.add_parser("validate", help="validate a params file (every profile)")
    v.add_argument("file", nargs="?", default="params.yaml")
    v.add_argument("--profile", help="also resolve this profile")

    for stage in STAGES:
        p = sub.add_parser(stage.name, help=stage.help)
        _common(p)
        if stage.name == "provision":
            p.add_argument(
                "--plan-only", action="store_true", help="print the spec's plan; start nothing"
            )
            p.add_argument(
                "--teardown", action="store_true", help="remove the spec's network namespaces"
            )
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
        "--mode",
        required=True,
        help=", ".join(serving_modes()),
    )
    e.add_argument("--host", help="bind address (default: serve.host, loopback)")
    e.add_argument("--port", type=int, help="port (default: serve.port)")

    sv = sub.add_parser("services", help="start, stop or list the spec's services (by PID)")
    sv.add_argument("action", choices=("up", "down", "status"))
    _common(sv)
    sv.add_argument(
        "--state", type=Path, default=Path("logs/services/state.json"), help=argparse.SUPPRESS
    )

    w = sub.add_parser(
        "standing", help="where a long run stands: each stage finished, part-way or not started"
    )
    w.add_argument("--root", type=Path, default=Path("."), help="the checkout (default: .)")
    w.add_argument("--profile", help="profile (default: the checkout's params.yaml `profile:`)")
    w.add_argument("--out", type=Path, metavar="FILE", help="also write the report as JSON")

    d = sub.add_parser("dvc-yaml", help="write dvc.yaml from the stage registry")
    d.add_argument("--check", action="store_true", help="exit 1 if dvc.yaml is out of date")

    m = sub.add_parser("manifests", help="render a GPU cluster spec's Kubernetes manifests")
    m.add_argument("--spec", type=Path, required=True, metavar="FILE", help="cluster spec")
    m.add_argument("--out", type=Path, metavar="DIR", help="write DIR/<spec>.yaml, not stdout")
    m.add_argument("--image", help="container image of every pod (default: dspark:<version>)")
    m.add_argument("--namespace", default="dspark", help="namespace (default: dspark)")
    m.add_argument("--check", action="store_true", help="exit 1 if DIR/<spec>.yaml is out of date")
    m.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    m.add_argument("--profile", help="profile (default: the file's `profile:`)")
    m.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return parser


def _load(args: argparse.Namespace):
    from dspark.config import load_params

    overrides = list(args.overrides)
    if getattr(args, "spec", None):
        overrides.append(f"provision.spec={args.spec}")
    return load_params(args.params, profile=args.profile, overrides=overrides)


def _on_trainer_node(args: argparse.Namespace, argv: list[str]) -> int | None:
    """With a netns spec, run this command inside the training node's namespace (after making
    the namespaces); return its exit code, or None to run here. `dspark run` also removes them."""
    from dspark.infra import netns
    from dspark.infra.plan import trainer_node
    from dspark.infra.spec import resolve

    spec = resolve(_load(args).provision.spec)
    if spec.kind != "netns" or netns.current() is not None:
        return None
    netns.up(spec)
    try:
        return netns.reexec_on(trainer_node(spec), argv)
    finally:
        if args.command == "run":
            netns.down(spec)


def _provision_tools(args: argparse.Namespace) -> int:
    """`provision --plan-only` and `--teardown`: nothing runs, nothing is written."""
    import json

    from dspark.infra import netns
    from dspark.infra.report import plan_table
    from dspark.infra.spec import resolve
    from dspark.provision import plan_only

    params = _load(args)
    spec = resolve(params.provision.spec)
    if args.teardown:
        netns.down(spec)
        print(f"{spec.name}: torn down", file=sys.stderr)
        return 0
    plan = plan_only(params, spec)
    print(plan_table(plan), file=sys.stderr)
    print(json.dumps(plan, indent=2))
    return 0 if all(c["ok"] for c in plan.get("checks", [])) else 1


def _run_stages(args: argparse.Namespace, names: list[str]) -> None:
    from dspark import pipeline

    params = _load(args)
    root = Path.cwd()
    ctx = pipeline.StageContext(
        params=params,
        root=root,
        progress=not args.no_progress,
        prompts_file=getattr(args, "prompts", None),
    )
    for name in names:
        doc = pipeline.run_stage(pipeline.get(name), ctx)
        print(f"{name}: done in {doc['wall_s']} s -> {pipeline.get(name).metrics}", file=sys.stderr)
    if len(names) > 1:
        pipeline.write_run_summary(root, params.profile)


def _endpoint(args: argparse.Namespace) -> int:
    from dspark import pipeline
    from dspark.errors import ConfigError
    from dspark.serve.server import serve

    params = _load(args)
    root = Path.cwd()
    host = args.host or params.serve.host
    port = params.serve.port if args.port is None else args.port
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port: {port} is not a port (1..65535)")
    serve(params, root / pipeline.TARGET_DIR, root / pipeline.DRAFTS, args.mode, host, port)
    return 0


def _services(args: argparse.Namespace) -> int:
    import json

    from dspark.infra import netns, services
    from dspark.infra.spec import resolve

    if args.action == "down":
        print(json.dumps({"stopped": services.down(args.state)}))
        return 0
    if args.action == "status":
        print(json.dumps(services.status(args.state), indent=2))
        return 0
    params = _load(args)
    spec = resolve(params.provision.spec)
    netns.up(spec)  # a master on a node needs the node
    wanted = services.wanted(spec, tracking_uri=params.tracking.mlflow_uri)
    state = services.up(wanted, args.state, args.state.parent)
    print(json.dumps({k: {"pid": v["pid"], "port": v["port"]} for k, v in state.items()}))
    return 0


def _manifests(args: argparse.Namespace) -> int:
    """`manifests`: the spec's Kubernetes objects as one YAML, on stdout or DIR/<spec>.yaml."""
    from dspark.errors import ConfigError
    from dspark.infra import k8s
    from dspark.infra.spec import load_spec
    from dspark.io import write_text

    if args.check and args.out is None:
        raise ConfigError("--check: compares DIR/<spec>.yaml, so it needs --out DIR")
    params, spec = _load(args), load_spec(args.spec)
    image = args.image if args.image is not None else k8s.DEFAULT_IMAGE
    objs = k8s.manifests(spec, params, image=image, namespace=args.namespace)
    text = k8s.to_yaml(objs, k8s.header(spec, params))
    if args.out is None:
        sys.stdout.write(text)
        return 0
    path = args.out / f"{spec.name}.yaml"
    if args.check:
        if not path.exists() or path.read_text() != text:
            again = f"dspark manifests --spec {args.spec} --out {args.out}"
            print(f"{path}: out of date (run {again})", file=sys.stderr)
            return 1
        return 0
    write_text(path, text)
    print(f"{path}: {len(objs)} objects", file=sys.stderr)
    return 0


def _standing(args: argparse.Namespace) -> None:
    from dspark.config import load_params
    from dspark.io import write_json
    from dspark.standing import render, standing

    profile = args.profile or load_params(args.root / "params.yaml").profile
    report = standing(args.root, profile)
    print(f"{args.root.resolve()} (profile {profile})\n{render(report)}")
    if args.out:
        write_json(args.out, {"profile": profile, "stages": report})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    from dspark.errors import DsparkError
    from dspark.procs import adopt_niceness
    from dspark.stopping import Stopped

    adopt_niceness()  # a stage a flow started in a session of its own keeps its niceness

    try:
        if args.command == "provision" and (args.plan_only or args.teardown):
            return _provision_tools(args)
        if args.command == "manifests":  # renders only: never moves onto a node
            return _manifests(args)
        if args.command == "services":
            return _services(args)
        if hasattr(args, "spec") and args.command != "endpoint":  # maybe on the training node
            code = _on_trainer_node(args, argv)
            if code is not None:
                return code
        if args.command == "validate":
            from dspark.config import load_params, profile_names
            from dspark.pipeline import check_profile_sections

            params = load_params(args.file, profile=args.profile)
            check_profile_sections(Path(args.file))
            print(
                f"{args.file}: ok (profiles: {', '.join(profile_names(args.file))}; "
                f"active: {params.profile})"
            )
        elif args.command == "run":
            from dspark.pipeline import STAGES

            _run_stages(args, [s.name for s in STAGES])
        elif args.command == "serve":
            # Prefect lives at the edge: the library only starts its process, in this one's
            # place (same PID), so a SIGTERM for `dspark serve` reaches flows.serve, which
            # stops the worker and its flow runs with it.
            env = {**os.environ, "DSPARK_POOL": args.pool}
            sys.stdout.flush()
            sys.stderr.flush()
            os.execve(sys.executable, [sys.executable, "-m", "flows.serve"], env)
        elif args.command == "endpoint":
            return _endpoint(args)
        elif args.command == "standing":
            _standing(args)
        elif args.command == "dvc-yaml":
            from dspark.io import write_text
            from dspark.pipeline import dvc_yaml

            text = dvc_yaml()
            if args.check:
                current = Path("dvc.yaml").read_text() if Path("dvc.yaml").exists() else ""
                if current != text:
                    print(
                        "dvc.yaml: out of date with dspark/pipeline.py (run `dspark dvc-yaml`)",
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
    except Stopped as e:  # asked to stop, and left a checkpoint to resume from
        print(f"dspark: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
