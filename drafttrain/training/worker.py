"""A recipe process started by `drafttrain launch`: the worker's half of the launch's contract.

torch's elastic agent (every multi-process launch) starts each worker in a session of its own, so
neither the terminal's Ctrl-C nor a signal to the launcher's process group reaches a worker: the
launcher forwards what it receives (`launch.ForwardCtrlC`; torch's agent SIGTERM and the like). A
launcher that dies without forwarding (SIGKILL, an out-of-memory kill) left workers that
answered, trained and wrote `final/` with nobody watching. So `drafttrain launch` runs each recipe as

    python -m drafttrain.training.worker SCRIPT ARGS...    (or -m MODULE ARGS...)

which, before the recipe imports anything:

- has the kernel kill this process when the launcher dies (`die_with_launcher`). Checkpoints are
  written whole or not at all and the run's lock is a flock, so the same command started again
  resumes from the newest intact checkpoint;
- answers a Ctrl-C that comes while the recipe still imports torch and transformers (seconds in
  which `recipe_main` is not running yet) as the recipe answers a later one: exit 130, where every
  process printed a KeyboardInterrupt traceback (`stop_at_once`). The one line is the launcher's
  (`say_interrupted`).

This module imports nothing heavy (nor does `drafttrain.training`'s `__init__`): it must run
before torch does.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

LAUNCHER_PID = "DRAFTTRAIN_LAUNCHER_PID"  # set by `drafttrain launch` for the processes it starts
INTERRUPTED = "interrupted; start the same command again to resume from the newest checkpoint"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def main(argv: list[str]) -> None:
    die_with_launcher()
    signal.signal(signal.SIGINT, stop_at_once)  # until the recipe runs: `ctrl_c_raises`
    try:
        run_recipe(argv)
    except SystemExit:
        raise
    except BaseException:  # a Ctrl-C the recipe's own handler (`recipe_main`) did not answer
        if not interrupted.is_set():
            raise
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C cannot cut this line short
        say_interrupted()
        exit_with(130)


def stop_at_once(signum, frame) -> None:
    """A Ctrl-C while the recipe still imports: nothing has started that needs cleaning up, and a
    KeyboardInterrupt raised here can land in torch's C++ (a pybind11 module importing Python),
    which aborts the process ("terminate called after throwing an instance of
    'pybind11::error_already_set'"), or leave numpy half-imported ("cannot load module more than
    once per process"). So the process ends here, 130. (A script that is no drafttrain recipe never
    calls `ctrl_c_raises`, and ends so at any moment.)"""
    say_interrupted()
    os._exit(130)


def ctrl_c_raises() -> None:
    """From here on (the recipe runs: `recipe_main`), a Ctrl-C in a launched recipe process is
    Python's KeyboardInterrupt, which the recipe answers after cleaning up, and is remembered:
    a peer that stopped first can fail this process's collective before its own KeyboardInterrupt
    is raised, which is this Ctrl-C's doing too (`main`). Elsewhere nothing changes."""
    if signal.getsignal(signal.SIGINT) is stop_at_once:
        signal.signal(signal.SIGINT, interrupt)


interrupted = threading.Event()


def interrupt(signum, frame) -> None:
    """Python's own Ctrl-C (`signal.default_int_handler`), remembered: `ctrl_c_raises`."""
    interrupted.set()
    raise KeyboardInterrupt


def run_recipe(argv: list[str]) -> None:
    """`python SCRIPT ARGS...` (or `python -m MODULE ARGS...`), in this process, as Python runs it:
    `__main__`, the same `sys.argv`, the script's folder first on `sys.path`."""
    if argv[:1] == ["-m"]:
        module, *args = argv[1:]
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, *args = argv
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def say_interrupted() -> None:
    """The Ctrl-C line, unless `drafttrain launch` started this process: the launcher says it then,
    once for all its processes (`launch.children_exit_code`). A worker cannot: the one that would
    say it may be stopped by torch's agent before it does, once another has exited."""
    if LAUNCHER_PID not in os.environ:
        say_once(INTERRUPTED)


def say_once(line: str) -> None:
    """`line` on stderr from the first process only: every rank of a launch fails (and is
    interrupted) alike, and says so once."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr, flush=True)


def exit_with(code: int) -> None:
    """A recipe process's exit: the run is over and its files written, so a Ctrl-C from here on (the
    terminal's reaches every process of a launch) is ignored during interpreter shutdown rather
    than a KeyboardInterrupt traceback from an atexit callback, and the exit code stays the run's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


# ----------------------------------------------------------------------------- the launcher's death


def die_with_launcher() -> None:
    """Be killed (SIGKILL: nothing to clean that a resumed run does not) when the launcher that
    started this process dies. Only for a direct child of the launcher (its torch agent and its
    one-process launcher both start the recipe themselves): one started through mpirun or a remote
    shell has a parent of its own to stop it (and so has one whose launcher died in the instant
    before this ran). Linux tells the kernel (PR_SET_PDEATHSIG, sent when the thread that started
    this process ends: the agent's main thread); elsewhere a thread watches the parent."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or os.getppid() != int(launcher):
        return
    if not kernel_kills_on_parent_death(signal.SIGKILL):
        threading.Thread(target=watch_parent, args=(int(launcher),), name="drafttrain-launcher-watch",
                         daemon=True).start()
    if os.getppid() != int(launcher):  # it died before the kernel was asked to tell
        os.kill(os.getpid(), signal.SIGKILL)


def kernel_kills_on_parent_death(sig: signal.Signals) -> bool:
    """Whether the kernel now sends `sig` to this process when its parent ends (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(parent: int, every: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(every)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    # `python -m` runs this file as a module named __main__, and the recipe imports it again by its
    # name: one module, or `ctrl_c_raises` would not know the handler `main` installed.
    from drafttrain.training import worker

    worker.main(sys.argv[1:])
