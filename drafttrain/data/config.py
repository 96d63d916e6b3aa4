"""Settings of the distillation data pipeline: where prompts come from and how the target answers them.

Plain documented dataclasses: `drafttrain.config.load_config` builds them from YAML (the
`sources` list included) and checks every key, so nothing here converts dicts by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config import documented
from ..errors import UserError
from ..home import drafttrain_home

SOURCE_KINDS = ("jsonl", "hf", "self_instruct")


def default_data_cache_dir() -> str:
    return str(drafttrain_home() / "data")


@dataclass
class PromptSourceConfig:
    kind: Literal["jsonl", "hf", "self_instruct"] = documented(
        "jsonl", doc="jsonl: a prompt file (SPEC section 1); hf: a `datasets` dataset; "
                     "self_instruct: prompts written by the target itself (Magpie)")
    path: str | None = documented(
        None, doc="jsonl: the file; hf: the dataset path/name passed to `datasets.load_dataset` "
                  "(e.g. \"json\" with `data_files`), or a directory written by `save_to_disk`")
    name: str | None = documented(None, doc="hf: the dataset config name")
    data_files: str | list[str] | None = documented(
        None, doc="hf: `data_files` for `load_dataset` (local json/csv/parquet files)")
    split: str = documented("train", doc="hf: the split, slices allowed (\"train[:1000]\")")
    column: str = documented(
        "prompt", doc="hf: the column holding a prompt string, a list of turns (the first is used), "
                      "or a messages list (cut after its first user message)")
    num_prompts: int | None = documented(
        None, doc="at most this many prompts from this source (the first ones); "
                  "self_instruct: how many to generate (required)")
    chat_template: bool = documented(
        True, doc="hf string columns: wrap the string as a user message through the chat template "
                  "(false: tokenize it verbatim)")
    temperature: float = documented(1.0, doc="self_instruct: sampling temperature (> 0)")
    top_p: float = documented(1.0, doc="self_instruct: nucleus sampling threshold")
    max_prompt_tokens: int = documented(
        64, doc="self_instruct: longest prompt; longer (unfinished) ones are dropped")
    min_prompt_chars: int = documented(8, doc="self_instruct: shorter prompts (after stripping) are dropped")

    def validate(self) -> None:
        """Checked when used, not at construction, so configs can be built and overridden field by field."""
        if self.kind not in SOURCE_KINDS:
            raise UserError(f"unknown prompt source kind {self.kind!r}; use one of {', '.join(SOURCE_KINDS)}")
        if self.kind in ("jsonl", "hf") and not self.path:
            raise UserError(f"a {self.kind} prompt source needs `path`; set it to the file or dataset")
        if self.kind == "self_instruct" and not self.num_prompts:
            raise UserError("a self_instruct prompt source needs `num_prompts` > 0; set how many prompts to generate")
        if self.num_prompts is not None and self.num_prompts < 0:
            raise UserError(f"num_prompts must be >= 0, got {self.num_prompts}")


@dataclass
class DataConfig:
    sources: list[PromptSourceConfig] = documented(
        default_factory=list, doc="prompt sources, concatenated in order")
    heldout_fraction: float = documented(
        0.1, doc="fraction of distinct prompts held out from training (by content hash)")
    heldout_size: int | None = documented(
        None, doc="hold out exactly this many distinct prompts instead of a fraction")
    seed: int = documented(0, doc="seed of the held-out split, self-instruct and response sampling")
    response_temperature: float = documented(0.0, doc="temperature of the target's responses; 0.0 = greedy")
    response_top_p: float = documented(1.0, doc="nucleus threshold of the target's responses")
    max_response_tokens: int = documented(128, doc="longest response the target writes")
    max_seq_len: int = documented(
        512, doc="longest training sequence (prompt + response); longer prompts are dropped")
    generation_batch_size: int = documented(16, doc="prompts per batched generate call")
    store_topk: int = documented(
        0, doc="0: store only response tokens; k > 0: also the target's k most likely tokens and "
               "their log-probs (temperature 1) at each response position, for offline distillation")
    prompt_loss_weight: float = documented(
        0.0, doc="distillation: weight of the prompt's own positions in the loss, next to the response's "
                 "(weight 1). The prompt runs through the draft anyway, so its positions add the "
                 "target's next-token distribution on more text for little compute; with store_topk > 0 "
                 "the target's top-k is stored at prompt positions too. 0: response positions only")
    cache_dir: str = documented(
        default_factory=default_data_cache_dir,
        doc="where generated responses are cached; default $DRAFTTRAIN_HOME/data "
            "(DRAFTTRAIN_HOME defaults to ~/.cache/drafttrain)")

    def validate(self) -> None:
        for src in self.sources:
            src.validate()
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise UserError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.heldout_size is not None and self.heldout_size < 0:
            raise UserError(f"heldout_size must be >= 0, got {self.heldout_size}")
        if self.response_temperature < 0:
            raise UserError(f"response_temperature must be >= 0 (0 = greedy), got {self.response_temperature}")
        if not 0.0 < self.response_top_p <= 1.0:
            raise UserError(f"response_top_p must be in (0, 1], got {self.response_top_p}")
        for key in ("max_response_tokens", "max_seq_len", "generation_batch_size"):
            if getattr(self, key) <= 0:
                raise UserError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.store_topk < 0:
            raise UserError(f"store_topk must be >= 0, got {self.store_topk}")
        if self.prompt_loss_weight < 0:
            raise UserError(f"prompt_loss_weight must be >= 0, got {self.prompt_loss_weight}")
