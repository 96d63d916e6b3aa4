"""`drafttrain compare`: several drafters, one target, one process, one shared baseline.

This is how the demo shows that a trained drafter beats its starting point and n-gram lookup:
every figure in the comparison table comes from the same run on the same prompts.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from .errors import UserError
from .evaluation import EvalConfig, add_decoding_args, config_from_args, run_evals
from .fileio import atomic_write_json, atomic_write_text
from .report import _fmt, plot_bars

KINDS = ("draft", "heads", "ngram", "none")


def parse_drafter(spec: str) -> tuple[str, dict]:
    """`NAME=draft:DIR`, `NAME=heads:DIR`, `NAME=ngram` or `NAME=none`."""
    name, sep, what = spec.partition("=")
    kind, _, path = what.partition(":")
    if not sep or not name or kind not in KINDS or (kind in ("draft", "heads")) != bool(path):
        raise UserError(f"--drafter {spec!r} is malformed; use NAME=draft:DIR, NAME=heads:DIR, NAME=ngram or NAME=none")
    if kind in ("draft", "heads"):
        return name, {kind: path}
    return name, {"method": kind}


def comparison_rows(names: list[str], reports: list[dict]) -> list[dict]:
    rows = []
    for name, r in zip(names, reports):
        o = r["overall"]
        rows.append({"drafter": name, "tau": o["mean_accepted_length"], "acceptance_rate": o["acceptance_rate"],
                     "speculative_tokens_per_s": o["speculative_tokens_per_s"],
                     "baseline_tokens_per_s": o["baseline_tokens_per_s"], "speedup": o["speedup"],
                     "outputs_match_baseline": o["outputs_match_baseline"]})
    return rows


def render_comparison(rows: list[dict], env: dict, cfg: EvalConfig) -> str:
    lines = [
        "# Drafter comparison", "",
        f"Target `{cfg.target}`, {len(rows)} drafters, K={cfg.num_draft_tokens}, temperature {cfg.temperature}, "
        f"max new tokens {cfg.max_new_tokens}, prompts {', '.join(cfg.prompts)} (limit {cfg.limit}), on "
        f"{env['device']}. One process: each prompt is decoded by the target alone, then by every drafter; "
        "speedups share that baseline.", "",
        "| drafter | tau | acceptance | tok/s | baseline tok/s | speedup | match baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['drafter']} | {_fmt(r['tau'])} | {_fmt(r['acceptance_rate'])} | "
                     f"{_fmt(r['speculative_tokens_per_s'], 1)} | {_fmt(r['baseline_tokens_per_s'], 1)} | "
                     f"{_fmt(r['speedup'], 2)} | {_fmt(r['outputs_match_baseline'], 2)} |")
    lines += ["", "![tau by drafter](tau.png)"]
    if any(r["speedup"] is not None for r in rows):
        lines += ["", "![speedup by drafter](speedup.png)"]
    lines += ["", "Each drafter's full report: `<drafter>/report.md`."]
    return "\n".join(lines) + "\n"


def run_compare(base: EvalConfig, drafters: list[str], progress: bool = True) -> list[dict]:
    parsed = [parse_drafter(d) for d in drafters]
    names = [n for n, _ in parsed]
    if len(set(names)) != len(names):
        raise UserError("drafter names must be unique; give each --drafter its own NAME")
    out = Path(base.out)
    cfgs = [replace(base, **{"draft": None, "heads": None, "method": None, **fields}, out=str(out / name))
            for name, fields in parsed]
    reports = run_evals(cfgs, progress=progress)
    rows = comparison_rows(names, reports)
    plot_bars({r["drafter"]: r["tau"] for r in rows}, out / "tau.png", "tau (mean accepted length)",
              "Mean accepted length by drafter", line=1.0)
    if any(r["speedup"] is not None for r in rows):
        plot_bars({r["drafter"]: r["speedup"] for r in rows}, out / "speedup.png", "speedup (×)",
                  "Measured speedup by drafter", line=1.0)
    atomic_write_text(out / "comparison.md", render_comparison(rows, reports[0]["environment"], cfgs[0]))
    atomic_write_json(out / "comparison.json", {"drafters": rows, "environment": reports[0]["environment"]})
    return reports


def add_cli(sub) -> None:
    p = sub.add_parser("compare", help="several drafters side by side on one target, in one run")
    p.add_argument("--target", required=True, help="target model: local directory or hub id")
    p.add_argument("--drafter", action="append", required=True,
                   help="NAME=draft:DIR, NAME=heads:DIR, NAME=ngram or NAME=none; repeatable")
    add_decoding_args(p)
    p.add_argument("--out", required=True, help="directory: comparison.md/json and one report per drafter")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    base = config_from_args(args, draft=None, heads=None, method="none")
    reports = run_compare(base, args.drafter, progress=not args.quiet)
    for spec, r in zip(args.drafter, reports):
        o = r["overall"]
        speed = f", speedup {o['speedup']:.2f}x" if o["speedup"] is not None else ""
        print(f"{spec.partition('=')[0]}: tau {o['mean_accepted_length']:.3f}{speed}")
    print(f"comparison in {args.out}/comparison.md")
    return 0
