"""Moved to `drafttrain.evaluation.metrics`; this alias stays only until `training/common.py`
imports from there (the coordinator switches it when merging, then deletes this file)."""

from .evaluation.metrics import PromptResult, compute_metrics  # noqa: F401
