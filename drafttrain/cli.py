"""`drafttrain` command line: subcommands live in their own modules; this file only dispatches."""

from __future__ import annotations

import argparse
import os
import sys

from .errors import UserError


def build_parser() -> argparse.ArgumentParser:
    from . import assets, bench, preflight
    from .evaluation import cli as evaluation
    from .training import launch

    parser = Parser(prog="drafttrain", description="Train drafters for speculative decoding and measure them.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in (evaluation, preflight, assets, bench, launch):
        module.add_cli(sub)
    return parser


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one `error:` line and exit 2, like every other bad input."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message}; see `{self.prog} --help`", file=sys.stderr)
        sys.exit(2)


def quiet_deepspeed_probe() -> None:
    """transformers imports deepspeed when it loads a model, and on a machine without a GPU
    deepspeed logs "Setting accelerator to CPU" on stderr: a second line beside an `error:` line.
    Naming the accelerator it would pick anyway keeps stderr to what drafttrain says."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


def main(argv: list[str] | None = None) -> int:
    """Every way out is one line: a UserError is `error: ...` and exit 2, Ctrl-C `interrupted` and
    exit 130. The Ctrl-C handler covers start-up too: the subcommands import torch and
    transformers, seconds in which a Ctrl-C used to end in a long KeyboardInterrupt traceback."""
    args = None
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["launch"] and argv[1:2] not in (["-h"], ["--help"]):  # accelerate's arguments, as they are
            from .training.launch import launch

            return launch(argv[1:], exiting=True)
        args = build_parser().parse_args(argv)
        quiet_deepspeed_probe()
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's 128 + SIGINT, nothing half-written
        print(f"{getattr(args, 'interrupted', 'interrupted')}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
