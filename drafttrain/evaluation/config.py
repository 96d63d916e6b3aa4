"""Settings of `eval` and `compare`: one dataclass from which the command-line flags, their
defaults, their `--help` text and their range checks are generated (`config.setting`,
`config.add_flags`, `config.check_settings`), so a default and a bound live in one place.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from ..config import check_settings, flag_name, setting
from ..decoding import NUM_DRAFT_TOKENS, DecodeSettings
from ..errors import UserError
from ..trees import TREE_CHOICES, read_tree_file

def int_or_auto(text: str) -> int | str:
    """A flag's K: an integer, or "auto"."""
    return "auto" if text == "auto" else int(text)


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "float64")
ENGINE_CHOICES = ("auto", "eager", "static")
BACKEND_CHOICES = ("drafttrain", "vllm")
PLAN_MAX_K = 6  # the deepest K that --num-draft-tokens auto considers (and calibration drafts)
PLAN_MAX_NODES = 64  # the largest tree that --tree-nodes auto considers
PLAN_PROBE_TOKENS = 16  # tokens a plan decodes past a probe prompt to time steps (caches hold them too)


@dataclass(kw_only=True)
class EvalConfig:
    """One drafter against the target on held-out prompts (SPEC §2); `compare` runs several that
    differ only in the drafter and the output directory."""

    target: str = setting(doc="Target model: a local directory or a hub id.", metavar="T")
    prompts: list[str] = setting(doc="JSONL prompt file (SPEC §1); repeat the flag for several files.",
                                 metavar="FILE")
    out: str = setting(doc="Report directory. One that exists and is not empty is refused unless --overwrite.",
                       metavar="DIR")
    draft: str | None = setting(None, "Draft model: a directory or hub id with the target's tokenizer.",
                                metavar="DIR", drafter=True)
    heads: str | None = setting(None, "Medusa heads directory (vLLM's format) trained on this target.",
                                metavar="DIR", drafter=True)
    eagle3: str | None = setting(None, "EAGLE-3 draft directory (SGLang's / vLLM's layout) trained on this target.",
                                 metavar="DIR", drafter=True)
    method: str | None = setting(None, "A drafter without weights: ngram (prompt lookup) or none (the target "
                                 "alone).", choices=("ngram", "none"), drafter=True)
    ngram: bool = setting(False, "With --draft, --heads or --eagle3: also look up an n-gram continuation each step and "
                          "verify it as one more branch of the drafter's chain or tree, in the same target pass "
                          "(greedy only).", drafter=True)
    name: str | None = setting(None, "The drafter's name in titles and tables (unset: the draft or heads "
                               "directory's name, else the method).", drafter=True)
    limit: int | None = setting(None, "At most N prompts from each prompt file (unset: all).", metavar="N",
                                at_least=1)
    num_draft_tokens: int | str = setting(
        NUM_DRAFT_TOKENS, "K: draft tokens per verification step (Medusa heads: the tree's depth cap), or auto: "
        "the K (0 = the target alone) that this machine's measured costs and the drafter's acceptance on other "
        "prompts favour (drafttrain.planning).", metavar="K|auto", at_least=1, parse=int_or_auto, auto=True)
    calibration_prompts: str | None = setting(
        None, "With --num-draft-tokens auto or --tree-nodes auto: a JSONL prompt file (not the evaluated prompts) "
        "whose first prompts measure the drafter's acceptance; without it, the acceptance its export recorded "
        "(drafttrain.json; draft models only, trees always need this file).", metavar="FILE")
    temperature: float = setting(0.0, "Sampling temperature; 0 is greedy decoding.", at_least=0)
    top_p: float = setting(1.0, "Nucleus sampling: keep the smallest set of tokens with this much probability.",
                           above=0, at_most=1)
    max_new_tokens: int = setting(128, "New tokens per prompt, at most (a prompt also ends at EOS).", metavar="N",
                                  at_least=1)
    seed: int = setting(0, "Seeds the run once: repeated prompts get independent samples, and the same command "
                        "gives the same outputs.")
    dtype: str = setting("auto", "Weights and compute dtype; auto is bfloat16 on CUDA, float32 on CPU.",
                         choices=DTYPE_CHOICES)
    device: str = setting("auto", "auto, cpu, cuda or cuda:N; auto is cuda when available.")
    baseline: str = setting("ours", "ours: also decode and time every prompt with the target alone on the same "
                            "engine (speedups, output matching); none: skip it.", choices=("ours", "none"))
    engine: str = setting("auto", "Decoding engine: eager is the model's own forward on a dynamic cache; static "
                          "a preallocated KV cache with compiled fixed-shape steps (CUDA graphs on CUDA; Llama, "
                          "Mistral, Qwen2, Qwen3); auto is static on CUDA where supported, else eager.",
                          choices=ENGINE_CHOICES)
    backend: str = setting("drafttrain", "Who decodes: drafttrain (its own lossless decoder) or vllm (vLLM's offline "
                           "engine, one prompt at a time, the same settings: served acceptance; needs the [vllm] "
                           "extra). In compare, a drafter may end in @vllm or @drafttrain instead.",
                           choices=BACKEND_CHOICES)
    ngram_max: int = setting(3, "Longest suffix n-gram that n-gram lookup matches.", metavar="N", at_least=1)
    tree: str = setting("auto", "Candidate tree of Medusa heads and EAGLE-3 drafts (greedy): auto (heads: the tree "
                        "calibrated when they were trained, else default; EAGLE-3: dynamic), default (a static "
                        "22-node tree), chain, dynamic (EAGLE-3 only: EAGLE-2's tree grown by draft confidence, "
                        "--tree-nodes nodes, K deep), or a JSON file of paths like [[0], [1], [0, 0]].")
    tree_nodes: int | str | None = setting(
        None, "Nodes verified per step, the pending token included: EAGLE-3's dynamic tree grows this many (unset: "
        "32); a static tree (Medusa heads', or --tree default/FILE) keeps its first N-1 paths best first (unset: "
        "all). auto: the size (and, for the dynamic tree, the top-k up to --tree-topk) that this machine's "
        "measured costs and the drafter's acceptance on --calibration-prompts favour (drafttrain.planning).",
        metavar="N|auto", at_least=2, parse=int_or_auto, auto=True)
    tree_topk: int = setting(4, "EAGLE-3 dynamic tree: nodes expanded per depth, and children drafted per node.",
                             metavar="N", at_least=1)
    overwrite: bool = setting(False, "Replace an earlier report in --out whole (nothing of it remains).")
    quiet: bool = setting(False, "No progress bar.")

    def validate(self) -> None:
        check_settings(self, flag_name)
        chosen = [x for x in (self.draft and "--draft", self.heads and "--heads", self.eagle3 and "--eagle3",
                              self.method and f"--method {self.method}") if x]
        if len(chosen) != 1:
            raise UserError("choose exactly one drafter: --draft DIR, --heads DIR, --eagle3 DIR, --method ngram or "
                            "--method none" + (f" (got {' and '.join(chosen)})" if chosen else ""))
        if self.ngram and self.method:
            raise UserError("--ngram joins n-gram lookup to a drafter with weights (--draft DIR, --heads DIR or "
                            "--eagle3 DIR); --method ngram alone needs no --ngram")
        if self.ngram and self.temperature > 0:
            raise UserError("--ngram verifies the n-gram branch and the drafter's as one tree, which is greedy; use "
                            "--temperature 0 or leave --ngram out")
        if not self.prompts:
            raise UserError("no prompt file given; pass --prompts FILE")
        if self.temperature == math.inf:
            raise UserError("--temperature must be finite (0 = greedy)")
        if self.calibration_prompts and not self.planned:
            raise UserError("--calibration-prompts measures acceptance for --num-draft-tokens auto or --tree-nodes "
                            "auto; add one, or leave --calibration-prompts out")
        if self.tree not in TREE_CHOICES:
            read_tree_file(self.tree)
        if self.tree == "dynamic" and self.heads:
            raise UserError("--tree dynamic grows a tree with an EAGLE-3 draft; Medusa heads use auto, default, chain "
                            "or a tree file")
        if self.backend == "vllm":
            from .vllm_backend import check_servable  # the one module that knows vLLM

            check_servable(self)

    @property
    def planned(self) -> bool:
        """K or the tree's size is left to the planner (`evaluation.plan`)."""
        return "auto" in (self.num_draft_tokens, self.tree_nodes)

    @property
    def max_draft_tokens(self) -> int:
        """The most drafts a step of this run may hold: K, or the deepest K a plan considers."""
        return PLAN_MAX_K if self.num_draft_tokens == "auto" else self.num_draft_tokens

    @property
    def max_tree_nodes(self) -> int | None:
        """The largest tree a step of this run may verify: the given size, or the largest a plan considers."""
        return PLAN_MAX_NODES if self.tree_nodes == "auto" else self.tree_nodes

    def decode_settings(self, *, generator=None, record_margins: bool = False, k: int | None = None,
                        nodes: int | None = None, topk: int | None = None) -> DecodeSettings:
        """What the decoder factory needs of these settings; `k`, `nodes` and `topk` override K, the
        tree's nodes and top-k (an `auto` one is resolved by `evaluation.plan` before decoding)."""
        if (k is None and self.num_draft_tokens == "auto") or (nodes is None and self.tree_nodes == "auto"):
            raise ValueError("--num-draft-tokens auto and --tree-nodes auto are resolved by evaluation.plan before "
                             "decoding")
        return DecodeSettings(num_draft_tokens=self.num_draft_tokens if k is None else k, temperature=self.temperature,
                              top_p=self.top_p, generator=generator, record_margins=record_margins, tree=self.tree,
                              tree_nodes=self.tree_nodes if nodes is None else nodes,
                              tree_topk=self.tree_topk if topk is None else topk, ngram_max=self.ngram_max,
                              ngram_hybrid=self.ngram)

    @property
    def drafter_kind(self) -> str:
        """draft | medusa | eagle3 | ngram | none: which kind of drafter runs (`decoding.factory.DRAFTERS`)."""
        return "draft" if self.draft else "medusa" if self.heads else "eagle3" if self.eagle3 else self.method

    @property
    def drafter_name(self) -> str:
        """What titles and tables call the drafter."""
        if self.name:
            return self.name
        path = self.draft or self.heads or self.eagle3
        served = "@vllm" if self.backend == "vllm" else ""
        if path:
            return (Path(path.rstrip("/")).name or path) + ("+ngram" if self.ngram else "") + served
        return str(self.method) + served

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Settings that may differ between the drafters of one `compare` run.
PER_DRAFTER = ("draft", "heads", "eagle3", "method", "ngram", "name", "out", "backend")


def shared_settings(cfg: EvalConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in PER_DRAFTER}
