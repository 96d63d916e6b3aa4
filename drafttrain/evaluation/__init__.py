"""Measuring drafters (SPEC §2): `eval`, `compare` and `replay`.

- `config`: EvalConfig / ReplayConfig, the one definition of every setting, its flag and default
- `run`: loading, the decoder factory and the interleaved timed run (`evaluate`, `run_eval`)
- `metrics`: METRICS from per-prompt records (tau, acceptance, predicted speedup, divergences)
- `report`: outputs.jsonl, report.json, report.md and the plots
- `outputs`: the `--out` directory, replaced whole and only when the report is complete
- `compare`: several drafters with one shared baseline
- `replay`: greedy acceptance from one forward pass over a report's target outputs
- `cli`: the three subcommands
"""

from .config import EvalConfig
from .metrics import PromptResult, compute_metrics, metrics_by_category
from .run import Evaluation, LoadedModels, evaluate, load_models, make_decoder, run_eval

__all__ = ["EvalConfig", "Evaluation", "LoadedModels", "PromptResult", "compute_metrics", "evaluate", "load_models",
           "make_decoder", "metrics_by_category", "run_eval"]
