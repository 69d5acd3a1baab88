"""`kubeon-gpu`: the optimizer's command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import yaml

from models.policy import PolicyError, parse_policy


def _validate(args: argparse.Namespace) -> int:
    """Validate GpuPolicy files as the optimizer would; print each problem with its field."""
    failed = 0
    for path in args.files:
        try:
            docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
        except (OSError, yaml.YAMLError) as exc:
            print(f"{path}: cannot read: {exc}", file=sys.stderr)
            failed += 1
            continue
        for index, doc in enumerate(docs):
            where = f"{path}" + (f"[{index}]" if len(docs) > 1 else "")
            try:
                policy = parse_policy(doc)
            except PolicyError as exc:
                failed += 1
                for field, msg in exc.errors:
                    print(f"{where}: {field}: {msg}", file=sys.stderr)
                continue
            mode = policy.spec.effective_mode(args.default_mode)
            print(f"{where}: ok: {policy.name} ({policy.spec.kind}, mode {mode})")
    return 1 if failed else 0


def _version(_: argparse.Namespace) -> int:
    print(json.dumps({"kubeon-gpu-optimizer": metadata.version("kubeon-gpu-optimizer")}))
    return 0


def _dev(_: argparse.Namespace) -> int:
    print(
        "kubeon-gpu dev: not available yet. It needs the burst workflow, the sim provider and the worker "
        "(issue: Burst end to end). The test harness is ready: `make test`.",
        file=sys.stderr,
    )
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubeon-gpu", description="KubeOn GPU optimizer")
    sub = parser.add_subparsers(dest="command", required=True)

    policy = sub.add_parser("policy", help="work with GpuPolicy documents")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    validate = policy_sub.add_parser("validate", help="validate GpuPolicy YAML files")
    validate.add_argument("files", nargs="+")
    validate.add_argument("--default-mode", default="Recommend", choices=["Recommend", "Approve", "Automatic"],
                          help="the installation's defaultMode, for policies that set none")
    validate.set_defaults(func=_validate)

    sub.add_parser("version", help="print the version").set_defaults(func=_version)
    sub.add_parser("dev", help="run everything locally").set_defaults(func=_dev)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
