"""`drafttrain` command line: subcommands live in their own modules; this file only dispatches."""

from __future__ import annotations

import argparse
import sys

from .errors import UserError


def build_parser() -> argparse.ArgumentParser:
    from . import assets, bench, comparison, evaluation, preflight

    parser = Parser(prog="drafttrain", description="Train drafters for speculative decoding and measure them.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (evaluation, comparison, preflight, assets, bench):
        module.add_cli(sub)
    return parser


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one `error:` line and exit 2, like every other bad input."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message}; see `{self.prog} --help`", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
