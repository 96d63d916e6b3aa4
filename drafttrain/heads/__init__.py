"""Medusa heads: the model, vLLM-format export, and static candidate trees for one-pass verification."""

from .calibrate import head_topk_accuracy
from .export import load_medusa, save_medusa
from .model import MedusaConfig, MedusaHeads
from .tree import (
    DEFAULT_TREE,
    TreeBuffers,
    build_tree_buffers,
    chain_tree,
    compact_cache,
    default_tree,
    expected_accepted_length,
    greedy_accept_tree,
    tree_attention_inputs,
    tree_candidates,
    tree_from_accuracies,
)

__all__ = [
    "DEFAULT_TREE", "MedusaConfig", "MedusaHeads", "TreeBuffers", "build_tree_buffers", "chain_tree",
    "compact_cache", "default_tree", "expected_accepted_length", "greedy_accept_tree", "load_medusa", "save_medusa",
    "tree_attention_inputs", "tree_candidates", "tree_from_accuracies", "head_topk_accuracy",
]
