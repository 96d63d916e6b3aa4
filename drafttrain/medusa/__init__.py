"""Medusa heads: the model, vLLM-format export, calibration of their tree, and their loss.

Candidate trees are `drafttrain.trees`; decoding with the heads is `drafttrain.decoding.drafters.medusa`.
"""

from .calibrate import head_topk_accuracy
from .export import load_medusa, save_medusa
from .model import MedusaConfig, MedusaHeads

__all__ = ["MedusaConfig", "MedusaHeads", "head_topk_accuracy", "load_medusa", "save_medusa"]
