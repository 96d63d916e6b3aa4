"""The `eval`, `compare` and `replay` subcommands: flags generated from the settings dataclasses,
a one-line summary on stdout, one `warning:` line on stderr per greedy divergence that is not a
near-tie."""

from __future__ import annotations

import argparse
import sys

from .compare import run_compare, served_checks, served_warnings
from ..config import add_flags, from_args
from ..kinds.registry import LOOKUPS, flagged, methods
from .config import EvalConfig
from .replay import ReplayConfig, format_results, run_replay
from .run import run_eval

INTERRUPTED_REPORT = "interrupted: no report written (an earlier report in --out is unchanged)"


def add_cli(sub) -> None:
    p = sub.add_parser("eval", help="measure acceptance and speedup of one drafter on held-out prompts",
                       description="One drafter against the target alone on held-out prompts (SPEC §2).")
    add_flags(p, EvalConfig)
    p.set_defaults(func=run_eval_cli, interrupted=INTERRUPTED_REPORT)

    p = sub.add_parser("compare", help="several drafters side by side on one target, in one run",
                       description="Several drafters on one target, one process, one shared baseline.")
    p.add_argument("--drafter", action="append", required=True, metavar="NAME=KIND[:DIR]",
                   help=", ".join([f"NAME={k.flag}:DIR" for k in flagged()] + [f"NAME={k.name}" for k in methods()])
                   + " (a drafter with weights may end in +LOOKUP: " + ", ".join(f"+{n}" for n in LOOKUPS)
                   + "), optionally ending in @vllm or @drafttrain (who decodes it; unset: --backend); repeat for "
                     "each drafter (required)")
    add_flags(p, EvalConfig, drafter=False, docs={
        "out": "Directory for comparison.md/json, the comparison plots and one report per drafter (NAME/). One "
               "that exists and is not empty is refused unless --overwrite."})
    p.set_defaults(func=run_compare_cli, interrupted=INTERRUPTED_REPORT)

    p = sub.add_parser("replay", help="greedy acceptance of drafts replayed over a report's target outputs",
                       description="One forward pass per prompt and draft over a greedy report's outputs.jsonl "
                                   "gives exactly the accepted lengths greedy decoding would; no timings.")
    add_flags(p, ReplayConfig)
    p.set_defaults(func=run_replay_cli, interrupted="interrupted")


def _summary(name: str, overall: dict) -> str:
    speed = f", speedup {overall['speedup']:.2f}x" if overall["speedup"] is not None else ""
    return f"{name}: tau {overall['mean_accepted_length']:.3f}, acceptance {overall['acceptance_rate']:.3f}{speed}"


def run_eval_cli(args: argparse.Namespace) -> int:
    cfg = from_args(EvalConfig, args)
    evaluation = run_eval(cfg, progress=not cfg.quiet)
    for line in evaluation.defect_warnings():
        print(line, file=sys.stderr)
    print(f"{_summary(evaluation.report['drafter'], evaluation.report['overall'])}; report in {cfg.out}/report.md")
    return 0


def run_compare_cli(args: argparse.Namespace) -> int:
    base = from_args(EvalConfig, args, method="none")
    evaluations = run_compare(base, args.drafter, progress=not base.quiet)
    for e in evaluations:
        for line in e.defect_warnings(prefix=f"{e.report['drafter']}: "):
            print(line, file=sys.stderr)
    for line in served_warnings(served_checks(evaluations)):
        print(line, file=sys.stderr)
    for e in evaluations:
        print(_summary(e.report["drafter"], e.report["overall"]))
    print(f"comparison in {base.out}/comparison.md")
    return 0


def run_replay_cli(args: argparse.Namespace) -> int:
    cfg = from_args(ReplayConfig, args)
    for line in format_results(run_replay(cfg, progress=not cfg.quiet)):
        print(line)
    return 0
