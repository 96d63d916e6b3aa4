"""The whole data side of distillation in one call: sources -> held-out split -> target's answers."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from ..errors import UserError
from ..models import context_length
from ..prompts import PromptRecord, encode_prompt
from ..tokens import eos_token_ids
from .config import DataConfig
from .generation import generate_responses, target_fingerprint
from .ranks import SINGLE, Ranks
from .sources import load_prompts_from_source, split_heldout


@dataclass
class TrainingData:
    train: object                    # datasets.Dataset of generate_responses rows
    heldout: list[PromptRecord]      # never trained on; write with sources.write_prompts_jsonl for eval


def prepare_distillation_data(cfg: DataConfig, target_model, tokenizer, *, target_path: str,
                              fingerprint: str | None = None, ranks: Ranks = SINGLE) -> TrainingData:
    """`fingerprint`: the target's `target_fingerprint`, when it was taken before the target was
    sharded (a sharded model's weights cannot be sampled outside its forward). `ranks`: the
    processes that write the self-instruct prompts and the answers together (collective)."""
    cfg.validate()
    if not cfg.sources:
        raise UserError("data.sources is empty; add at least one prompt source (jsonl, hf or self_instruct)")
    fingerprint = fingerprint or target_fingerprint(target_path, target_model)
    records: list[PromptRecord] = []
    for src in cfg.sources:
        records += load_prompts_from_source(src, tokenizer, target_model, seed=cfg.seed,
                                            batch_size=cfg.generation_batch_size, cache_dir=cfg.cache_dir,
                                            target_fingerprint=fingerprint, ranks=ranks)
    train, heldout = split_heldout(records, fraction=cfg.heldout_fraction, size=cfg.heldout_size, seed=cfg.seed)

    # A prompt must leave room for at least one response token, in training and in the model's context.
    limit = cfg.max_seq_len
    ctx = context_length(target_model)
    if ctx is not None:
        limit = min(limit, ctx - cfg.max_response_tokens + 1)
    kept = [r for r in train if len(encode_prompt(r, tokenizer)) < limit]
    if len(kept) < len(train):
        warnings.warn(f"dropped {len(train) - len(kept)} training prompt(s) of {limit} tokens or more "
                      "(max_seq_len / the target's context); raise max_seq_len to keep them")
    if not kept:
        raise UserError("no training prompts left after the held-out split and the length filter; "
                        "add prompts, lower heldout_fraction/heldout_size or raise max_seq_len")
    dataset = generate_responses(target_model, tokenizer, kept, cfg,
                                 eos_token_id=eos_token_ids(tokenizer, target_model, required=True),
                                 cache_dir=cfg.cache_dir, target_fingerprint=fingerprint, ranks=ranks,
                                 target_path=target_path)
    return TrainingData(train=dataset, heldout=heldout)
