"""Settings of the distillation data pipeline: where prompts come from and how the target answers them.

Plain documented dataclasses: `drafttrain.config.load_config` builds them from YAML (the
`sources` list included) and checks every key, so nothing here converts dicts by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config import check_settings, setting
from ..errors import UserError
from ..home import drafttrain_home

SOURCE_KINDS = ("jsonl", "hf", "self_instruct")
GENERATORS = ("drafttrain", "vllm")


def default_data_cache_dir() -> str:
    return str(drafttrain_home() / "data")


@dataclass
class PromptSourceConfig:
    kind: Literal["jsonl", "hf", "self_instruct"] = setting(
        "jsonl", doc="jsonl: a prompt file (SPEC section 1); hf: a `datasets` dataset; "
                     "self_instruct: prompts written by the target itself (Magpie)")
    path: str | None = setting(
        None, doc="jsonl: the file; hf: the dataset path/name passed to `datasets.load_dataset` "
                  "(e.g. \"json\" with `data_files`), or a directory written by `save_to_disk`")
    name: str | None = setting(None, doc="hf: the dataset config name")
    data_files: str | list[str] | None = setting(
        None, doc="hf: `data_files` for `load_dataset` (local json/csv/parquet files)")
    split: str = setting("train", doc="hf: the split, slices allowed (\"train[:1000]\")")
    column: str = setting(
        "prompt", doc="hf: the column holding a prompt string, a list of turns (the first is used), "
                      "or a messages list (cut after its first user message)")
    num_prompts: int | None = setting(
        None, doc="at most this many prompts from this source (the first ones); "
                  "self_instruct: how many to generate (required)", at_least=0)
    chat_template: bool = setting(
        True, doc="hf string columns: wrap the string as a user message through the chat template "
                  "(false: tokenize it verbatim)")
    temperature: float = setting(1.0, doc="self_instruct: sampling temperature (> 0)")
    top_p: float = setting(1.0, doc="self_instruct: nucleus sampling threshold")
    max_prompt_tokens: int = setting(
        64, doc="self_instruct: longest prompt; longer (unfinished) ones are dropped")
    min_prompt_chars: int = setting(8, doc="self_instruct: shorter prompts (after stripping) are dropped")

    def validate(self) -> None:
        """Checked when used, not at construction, so configs can be built and overridden field by field."""
        check_settings(self, lambda key: f"data.sources.{key}")
        if self.kind not in SOURCE_KINDS:
            raise UserError(f"unknown prompt source kind {self.kind!r}; use one of {', '.join(SOURCE_KINDS)}")
        if self.kind in ("jsonl", "hf") and not self.path:
            raise UserError(f"a {self.kind} prompt source needs `path`; set it to the file or dataset")
        if self.kind == "self_instruct" and not self.num_prompts:
            raise UserError("a self_instruct prompt source needs `num_prompts` > 0; set how many prompts to generate")


@dataclass
class DataConfig:
    sources: list[PromptSourceConfig] = setting(
        default_factory=list, doc="prompt sources, concatenated in order")
    heldout_fraction: float = setting(
        0.1, doc="fraction of distinct prompts held out from training (by content hash)", at_least=0, below=1)
    heldout_size: int | None = setting(
        None, doc="hold out exactly this many distinct prompts instead of a fraction", at_least=0)
    seed: int = setting(0, doc="seed of the held-out split, self-instruct and response sampling")
    response_temperature: float = setting(0.0, doc="temperature of the target's responses; 0.0 = greedy",
                                          at_least=0)
    response_top_p: float = setting(1.0, doc="nucleus threshold of the target's responses", above=0, at_most=1)
    max_response_tokens: int = setting(128, doc="longest response the target writes", at_least=1)
    max_seq_len: int = setting(
        512, doc="longest training sequence (prompt + response); longer prompts are dropped", at_least=1)
    generator: Literal["drafttrain", "vllm"] = setting(
        "drafttrain", doc="what writes the target's answers: drafttrain (its own engines; under `accelerate launch` "
                          "every rank writes a share of the prompts) or vllm (vLLM's offline engine, on the main "
                          "process; needs vLLM installed: pip install 'drafttrain[vllm]' or "
                          "bash scripts/setup_vllm.sh)", choices=GENERATORS)
    generation_batch_size: int | None = setting(
        None, doc="prompts per batch of the target's answers (and of self-instruct prompts); null: measured "
                  "before writing: the first chunk (the longest prompts) written at 8, 16, .. rows and timed, "
                  "the smallest batch within 5% of the fastest chosen and its chunk kept", at_least=1)
    store_topk: int = setting(
        0, doc="0: store only response tokens; k > 0: also the target's k most likely tokens and "
               "their log-probs (temperature 1) at each response position, for offline distillation", at_least=0)
    prompt_loss_weight: float = setting(
        0.0, doc="distillation: weight of the prompt's own positions in the loss, next to the response's "
                 "(weight 1). The prompt runs through the draft anyway, so its positions add the "
                 "target's next-token distribution on more text for little compute; with store_topk > 0 "
                 "the target's top-k is stored at prompt positions too. 0: response positions only",
        at_least=0)
    cache_dir: str = setting(
        default_factory=default_data_cache_dir,
        doc="where generated responses are cached; default $DRAFTTRAIN_HOME/data "
            "(DRAFTTRAIN_HOME defaults to ~/.cache/drafttrain)")

    def validate(self) -> None:
        for src in self.sources:
            src.validate()
        check_settings(self, lambda key: f"data.{key}")
        if self.generator == "vllm":
            from ..evaluation.vllm_backend import INSTALL, vllm_version

            if vllm_version() is None:
                raise UserError(f"data.generator=vllm needs vLLM, which is not installed here: {INSTALL}; "
                                "or set data.generator=drafttrain")
