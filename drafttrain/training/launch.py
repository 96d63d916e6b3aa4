"""`drafttrain launch`: `accelerate launch` that keeps drafttrain's error contract.

accelerate's launcher runs a recipe in child processes and turns any failure of theirs into its
own traceback: a recipe's one `error:` line (exit 2) comes back followed by a CalledProcessError
traceback and exit 1, and a Ctrl-C ends in the recipe's one line and then the launcher's
traceback. This runs accelerate's own launcher, with the same arguments, in this process, and
leaves the talking to the recipe: a child's exit code becomes this process's exit code, with
nothing added (the child has said what went wrong). Except for a Ctrl-C: this process says its
one line, once for every process (`children_exit_code`), and exits 130.

Signals, and who must hear them. One process: the recipe shares this process's group, so the
terminal's Ctrl-C reaches it directly, and this process waits for it. Several: torch's elastic
agent (run here, by accelerate) starts every worker in a session of its own, which the terminal's
Ctrl-C never reaches. The agent would catch it here, stop the workers itself and raise (a
traceback, exit 1), even when the workers had finished; so this process forwards a Ctrl-C to the
workers (`ForwardCtrlC`) and ends by their exit codes, as one process would: 130 and one line, or
0 when they were done. SIGTERM, SIGHUP and SIGQUIT stay the agent's to forward (then 128 + N and
one line). Every recipe runs through `training.worker`, which dies with this process (a SIGKILL
forwards nothing) and answers a Ctrl-C during its imports as the recipe does later.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading

from .worker import INTERRUPTED, LAUNCHER_PID

WORKER_MODULE = "drafttrain.training.worker"
AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # the handlers torch's agent installs
AGENT_HANDLES = "SIGTERM,SIGHUP,SIGQUIT"  # its --signals_to_handle: SIGINT is `ForwardCtrlC`'s


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
    from torch.distributed.elastic.multiprocessing.api import SignalException

    args = launch_command_parser().parse_args(argv)
    through_worker(args)
    args.signals_to_handle = AGENT_HANDLES  # passed on to torch's agent (`torch.distributed.run`'s option)
    quiet_elastic_logs()
    previous = {sig: signal.getsignal(sig) for sig in AGENT_SIGNALS}
    forward = ForwardCtrlC()
    signal.signal(signal.SIGINT, forward)
    try:
        with environment({LAUNCHER_PID: str(os.getpid())}):
            launch_command(args)
    except subprocess.CalledProcessError as e:  # one process: accelerate's simple launcher
        return children_exit_code([e.returncode], forward.received)
    except SystemExit as e:  # accelerate's --quiet, or argparse
        return e.code if isinstance(e.code, int) else 1
    except SignalException as e:  # several: torch's agent stopped every worker on SIGTERM, SIGHUP or SIGQUIT
        return children_exit_code([-int(e.sigval)])
    except Exception as e:  # several: torch's ChildFailedError names each rank's exit code
        codes = [getattr(f, "exitcode", None) for f in getattr(e, "failures", {}).values()]
        codes = [c for c in codes if isinstance(c, int)]
        if not codes:
            raise
        return children_exit_code(codes, forward.received)
    finally:  # torch's agent leaves its handlers, which raise on a signal: put back what was there
        forward.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, ignore if exiting and sig == signal.SIGINT else handler)
    return 0


def ignore(signum, frame) -> None:
    """SIGINT as this process exits: the recipe has answered it, or finished."""


class ForwardCtrlC:
    """This process's SIGINT handler for a launch. The workers in sessions of their own (torch's
    agent's) get it forwarded: they end with 130, and the agent reports their exit codes. One
    sharing this process's group (one process) had it from the terminal already. A worker still
    running `shutdown_timeout` seconds later (a collective waiting on a peer that is gone can wait
    for the process group's timeout, hours) is killed, as torch's agent would
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s). Nothing to forward to (a launch not yet started, or its
    workers done): nothing happens, as in one process. A handler, not SIG_IGN: an ignored signal
    stays ignored in the children, a handler does not survive their exec."""

    def __init__(self, shutdown_timeout: float | None = None):
        self.shutdown_timeout = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30)
                                      if shutdown_timeout is None else shutdown_timeout)
        self.deadline: threading.Timer | None = None
        self.received = False  # a Ctrl-C came during the launch: this process says its line

    def __call__(self, signum, frame) -> None:
        self.received = True
        groups = signal_worker_groups(signal.SIGINT)
        if groups and self.deadline is None:
            self.deadline = threading.Timer(self.shutdown_timeout, signal_worker_groups, (signal.SIGKILL,))
            self.deadline.daemon = True
            self.deadline.start()

    def cancel(self) -> None:
        """The launch is over: no deadline may outlive it (its children are others')."""
        if self.deadline is not None:
            self.deadline.cancel()


def signal_worker_groups(sig: signal.Signals) -> list[int]:
    """Send `sig` to the process group of each child of this process that is not in this process's
    group (a worker of torch's agent leads a session of its own, with whatever it starts); the
    groups signalled."""
    import psutil

    own, groups = os.getpgrp(), []
    for child in psutil.Process().children():
        with contextlib.suppress(OSError):
            group = os.getpgid(child.pid)
            if group != own:
                os.killpg(group, sig)
                groups.append(group)
    return groups


def through_worker(args) -> None:
    """Start the recipe as `python -m drafttrain.training.worker RECIPE ARGS...` (`-m RECIPE ...`
    for a module): see `training.worker`. Not for --no_python, whose recipe is no Python file."""
    if args.no_python:
        return
    args.training_script_args = [*(["-m"] if args.module else []), args.training_script, *args.training_script_args]
    args.training_script, args.module = WORKER_MODULE, True


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """`values` in this process's environment (so in the recipe's) for the launch only."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def quiet_elastic_logs() -> None:
    """torch's launcher logs on stderr what the recipe's own line says already: a failed child's
    report, "Received 2 death signal, shutting down workers", "Sending process N closing signal".
    Its loggers each set a level of their own (LOGLEVEL, else WARNING), so the level of their
    parent `torch.distributed` alone does not reach them: each is set."""
    import torch.distributed.run  # noqa: F401  creates the launcher's and the agent's loggers

    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def children_exit_code(codes: list[int], ctrl_c: bool = False) -> int:
    """This process's exit code for its children's, and its one line. Interrupted (`ctrl_c`: a Ctrl-C
    came, and a child failed; or a child answered one, exit 130) is 130 and the Ctrl-C line of a
    one-process run, said here for every process (they say nothing under a launcher: the one that
    would could be stopped by torch's agent first). A child killed by signal N (exit code -N, which
    `sys.exit` would turn into 256 - N: 254 for SIGINT) is the shell's 128 + N, said in one line, as
    a killed child says nothing itself; SIGINT (130) wins over any other code."""
    if 130 in codes or (ctrl_c and any(codes)):
        print(INTERRUPTED, file=sys.stderr, flush=True)
        return 130
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
