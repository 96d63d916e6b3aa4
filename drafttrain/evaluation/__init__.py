"""Measuring drafters (SPEC §2): `eval`, `compare` and `replay`.

- `config`: EvalConfig, the one definition of every eval/compare setting, its flag and default
- `loading`: the target and its one drafter (loaded by its kind), checked, bound to their engines
- `run`: the interleaved timed run (`evaluate`, `run_eval`), decoders from `decoding.build_decoder`
- `plan`: `--num-draft-tokens auto` / `--tree-nodes auto`: K and the tree from measured costs
- `costs`: timing a decode (a forward's cost is `decoding.timing`'s, a drafter's step its kind's)
- `vllm_backend`: `--backend vllm`, the same drafter served by vLLM (the one module importing vLLM)
- `summary`: one drafter's report.json dict
- `metrics`: METRICS from per-prompt records (tau, acceptance, predicted speedup, divergences)
- `report`: outputs.jsonl, report.json, report.md and the plots
- `outputs`: the `--out` directory, replaced whole and only when the report is complete
- `compare`: several drafters with one shared baseline
- `replay`: ReplayConfig and greedy acceptance from one forward pass over a report's target outputs
- `cli`: the three subcommands
"""

from .config import EvalConfig
from .metrics import PromptResult, compute_metrics, metrics_by_category
from .loading import LoadedModels, load_models
from .run import Evaluation, evaluate, make_decoder, run_eval

__all__ = ["EvalConfig", "Evaluation", "LoadedModels", "PromptResult", "compute_metrics", "evaluate", "load_models",
           "make_decoder", "metrics_by_category", "run_eval"]
