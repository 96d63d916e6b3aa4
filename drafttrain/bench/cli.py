"""The `drafttrain bench` subcommand: flags from `BenchConfig`, the run, one summary line."""

from __future__ import annotations

import sys
from pathlib import Path

from ..config import add_command
from .config import BenchConfig
from .run import run_bench


def add_cli(sub) -> None:
    add_command(sub, "bench", BenchConfig, run_cli,
                help="measure the decode engine against the memory-bandwidth roofline")


def run_cli(cfg: BenchConfig) -> int:
    log = (lambda *a: None) if cfg.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    b = run_bench(cfg, log=log)
    best = max((r["tokens_per_s"]["median"], n) for n, r in b["plain_decoding"].items() if "tokens_per_s" in r)
    print(f"roofline {b['roofline_tokens_per_s']:.1f} tok/s; best plain decoding {best[0]:.1f} tok/s ({best[1]}); "
          f"report in {Path(cfg.out) / 'bench.md'}")
    return 0
