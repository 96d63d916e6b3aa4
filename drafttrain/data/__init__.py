"""Distillation data: prompt sources, the target's own responses (cached), and loss-masked batches."""

from .collate import DistillCollator, collate, pack_example
from .config import DataConfig, PromptSourceConfig
from .generation import end_token_ids, generate_responses, target_fingerprint
from .pipeline import DistillData, prepare_distillation_data
from .sources import load_prompts_from_source, self_instruct_prompts, split_heldout, write_prompts_jsonl

__all__ = [
    "DataConfig", "PromptSourceConfig", "DistillCollator", "DistillData", "collate", "end_token_ids",
    "generate_responses", "load_prompts_from_source", "pack_example", "prepare_distillation_data",
    "self_instruct_prompts", "split_heldout", "target_fingerprint", "write_prompts_jsonl",
]
