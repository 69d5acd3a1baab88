"""The command line of the small benches: a few ``--name VALUE`` options, each typed as its default."""

from __future__ import annotations

import argparse


def parse_options(prog: str, doc: str | None, argv: list[str] | None, **defaults: float) -> argparse.Namespace:
    """One ``--name`` option per default (``operation_seconds``: ``--operation-seconds``), of its default's type."""
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    return parser.parse_args(argv)
