"""`drafttrain launch`: `accelerate launch` that keeps drafttrain's error contract.

accelerate's launcher runs a recipe in child processes and turns any failure of theirs into its
own traceback: a recipe's one `error:` line (exit 2) comes back followed by a CalledProcessError
traceback and exit 1, and a Ctrl-C (which reaches every process of the terminal's group) ends in
the recipe's one line and then the launcher's KeyboardInterrupt traceback. This runs accelerate's
own launcher, with the same arguments, in this process, and leaves the talking to the recipe: a
child's exit code becomes this process's exit code, with nothing added (the child has said what
went wrong), and Ctrl-C is left to the children, which end with their one line and exit 130.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys


def add_cli(sub) -> None:
    p = sub.add_parser("launch", help="accelerate launch, with one error line and the recipe's exit code",
                       description="Run `accelerate launch ARGS...` (any of its arguments, then the recipe and its "
                                   "own arguments) so that a failed recipe ends with its own one line and exit "
                                   "code: 2 for bad input, 130 for Ctrl-C.")
    p.add_argument("args", nargs="...", help="accelerate launch's arguments, e.g. --config_file "
                                            "recipes/accelerate/single.yaml recipes/distill.py --config FILE")
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    return launch(args.args)


def launch(argv: list[str], exiting: bool = False) -> int:
    """accelerate launch `argv`; the recipe's exit code (0 when every process succeeded). `exiting`:
    this process ends when this returns (the command line), so the Ctrl-C handler stays: a Ctrl-C
    that reaches it during interpreter shutdown is otherwise a KeyboardInterrupt traceback from
    an atexit callback."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(argv)
    # Ctrl-C reaches the recipe's processes too: they end with their own line; this process waits
    # for them instead of dying mid-wait with a traceback. A handler, not SIG_IGN: an ignored signal
    # stays ignored in the children, a handler does not survive their exec.
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    # torch's elastic agent (multi-process launches) logs a failed child's report on stderr.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        launch_command(args)
    except subprocess.CalledProcessError as e:  # one process: accelerate's simple launcher
        return children_exit_code([e.returncode])
    except SystemExit as e:  # accelerate's --quiet, or argparse
        return e.code if isinstance(e.code, int) else 1
    except Exception as e:  # several processes: torch's ChildFailedError names each rank's exit code
        codes = [getattr(f, "exitcode", None) for f in getattr(e, "failures", {}).values()]
        codes = [c for c in codes if isinstance(c, int)]
        if not codes:
            raise
        return children_exit_code(codes)
    finally:
        if not exiting:
            signal.signal(signal.SIGINT, previous)
    return 0


def children_exit_code(codes: list[int]) -> int:
    """This process's exit code for its children's. A child killed by signal N (exit code -N, which
    `sys.exit` would turn into 256 - N: 254 for SIGINT) is the shell's 128 + N, said in one line, as
    a killed child says nothing itself; Ctrl-C (130) wins over any other code."""
    mapped = [128 - c if c < 0 else c for c in codes]
    signalled = next((-c for c in codes if c < 0), None)
    if signalled is not None:
        print(f"{'interrupted' if signalled == signal.SIGINT else 'killed'}: the recipe's process ended on "
              f"{signal_name(signalled)}; started again with the same output directory, it resumes from its newest "
              "checkpoint", file=sys.stderr)
    return 130 if 130 in mapped else max(mapped)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
