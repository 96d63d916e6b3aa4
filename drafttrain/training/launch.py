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


def launch(argv: list[str]) -> int:
    """accelerate launch `argv`; the recipe's exit code (0 when every process succeeded)."""
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
        return e.returncode
    except SystemExit as e:  # accelerate's --quiet, or argparse
        return e.code if isinstance(e.code, int) else 1
    except Exception as e:  # several processes: torch's ChildFailedError names each rank's exit code
        codes = [getattr(f, "exitcode", None) for f in getattr(e, "failures", {}).values()]
        codes = [c for c in codes if isinstance(c, int)]
        if not codes:
            raise
        return 130 if 130 in codes or -signal.SIGINT in codes else max(codes, key=abs)
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0
