"""Distillation data: prompt sources, the target's own responses (cached), loss-masked batches,
and on-policy batches sampled from the draft."""

from .collate import TrainingCollator, collate, pack_example, response_window
from .config import DataConfig, PromptSourceConfig
from .generation import generate_responses, target_fingerprint
from .onpolicy import onpolicy_batch, onpolicy_step
from .pipeline import TrainingData, prepare_distillation_data
from .ranks import SINGLE, Ranks
from .sources import load_prompts_from_source, self_instruct_prompts, split_heldout, write_prompts_jsonl

__all__ = [
    "DataConfig", "PromptSourceConfig", "Ranks", "SINGLE", "TrainingCollator", "TrainingData", "collate", "generate_responses",
    "load_prompts_from_source", "onpolicy_batch", "onpolicy_step", "pack_example", "prepare_distillation_data",
    "response_window", "self_instruct_prompts", "split_heldout", "target_fingerprint", "write_prompts_jsonl",
]
