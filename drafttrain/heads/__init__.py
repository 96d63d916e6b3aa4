"""Medusa heads: the model, vLLM-format export, calibration, and candidate trees as data.

Running a tree (buffers, masks, acceptance, cache compaction) lives in `drafttrain.decoding`.
"""

from .calibrate import head_topk_accuracy
from .export import load_medusa, save_medusa
from .model import MedusaConfig, MedusaHeads
from .tree import (
    DEFAULT_TREE,
    chain_tree,
    check_paths,
    default_tree,
    expected_accepted_length,
    tree_from_accuracies,
)

__all__ = [
    "DEFAULT_TREE", "MedusaConfig", "MedusaHeads", "chain_tree", "check_paths", "default_tree",
    "expected_accepted_length", "head_topk_accuracy", "load_medusa", "save_medusa", "tree_from_accuracies",
]
