"""The one decoder factory: every decoder of eval, compare, replay, bench and the recipes is built here.

A drafter kind is a name in `DRAFTERS` and a function that builds its decoder from the target
(a `CachedLM`), the loaded `Drafter` and the run's `DecodeSettings`. A new kind is one new file
under `drafters/` plus one line in `DRAFTERS`. Trees are chosen once, by `trees.resolve_tree`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..tokens import output_vocab_size
from ..trees import resolve_tree
from .chain import ChainDecoder, NoProposer, Proposer
from .drafters.draft_lm import DraftModelProposer
from .drafters.eagle3 import eagle3_decoder
from .drafters.hybrid import hybrid_decoder
from .drafters.medusa import medusa_decoder
from .drafters.ngram import NgramProposer
from .drafters.oracle import OracleProposer
from .drafters.parallel_lm import ParallelDraftProposer
from .engines import CachedLM, as_cached_lm
from .loop import Decoder

HYBRID_KINDS = ("draft", "parallel_draft", "eagle3", "medusa")  # drafters that take +ngram (greedy)
NUM_DRAFT_TOKENS = 4  # K, the default of every entry point that decodes (eval, compare, replay, bench, recipes)
DYNAMIC_TREE_NODES = 32  # EAGLE-2's dynamic tree when no node count is given


@dataclass(frozen=True)
class DecodeSettings:
    """What every decoder of a run shares, whatever its drafter."""

    num_draft_tokens: int = NUM_DRAFT_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    eos_token_ids: frozenset = frozenset()
    generator: torch.Generator | None = None
    record_margins: bool = False      # greedy: keep the target's top-1 minus top-2 logit per token
    tree: str = "auto"                # --tree: auto, default, chain, dynamic or a JSON file of paths
    tree_nodes: int | None = None     # nodes per step, pending included: the dynamic tree's (None: 32),
                                      # a static tree's first ones best first (None: all)
    tree_topk: int = 4                # EAGLE-3 dynamic tree: nodes expanded per depth
    ngram_max: int = 3                # n-gram drafting: the longest suffix looked up
    ngram_hybrid: bool = False        # +ngram: n-gram lookup's chain, one more branch of the drafter's chain or tree

    @property
    def dynamic_nodes(self) -> int:
        """The nodes of EAGLE-2's dynamic tree."""
        return self.tree_nodes or DYNAMIC_TREE_NODES


@dataclass
class Drafter:
    """A loaded drafter: its kind (a key of `DRAFTERS`), its model (a draft LM, sequential or
    parallel with `info["pard_token"]`, or its cached LM,
    Medusa heads, an EAGLE-3 draft or its cached draft, an oracle's references; None for n-gram
    and plain decoding) and what its export recorded (`info`: e.g. the heads' calibrated tree)."""

    kind: str
    model: object = None
    info: dict = field(default_factory=dict)


def tree_choice(drafter: Drafter, s: DecodeSettings) -> tuple[str, list | str] | None:
    """(the tree's name for reports, paths or "dynamic") a tree drafter verifies, or None for a
    chain. Medusa heads draft a chain as deep as the tree when sampling."""
    if drafter.kind == "medusa":
        depth = min(s.num_draft_tokens, drafter.model.config.num_heads)  # head i drafts position i + 1
        name, paths = resolve_tree(s.tree, depth, auto=drafter.info.get("tree"), nodes=s.tree_nodes)
        return (name if s.temperature == 0 else "chain (sampling)"), paths
    if drafter.kind == "eagle3":
        if s.temperature > 0 or s.tree == "chain":
            return None
        name, paths = resolve_tree(s.tree, s.num_draft_tokens, auto="dynamic", nodes=s.tree_nodes)
        return (f"dynamic ({s.dynamic_nodes} nodes, top-{s.tree_topk})" if paths == "dynamic" else name), paths
    return None


def tree_name(drafter: Drafter, s: DecodeSettings) -> str | None:
    """The report's name of the tree or chain a tree-capable drafter (or any +ngram hybrid) verifies;
    None for chain drafters."""
    if s.ngram_hybrid:
        model = tree_name(drafter, replace(s, ngram_hybrid=False)) or "model chain"
        return f"{model} + n-gram chain (up to {s.num_draft_tokens} nodes)"
    tree = tree_choice(drafter, s)
    if tree is not None:
        return tree[0]
    if drafter.kind == "eagle3":
        return "chain" if s.temperature == 0 else "chain (sampling)"
    return None


def max_step_tokens(drafter: Drafter, s: DecodeSettings) -> int:
    """The most tokens one verification step adds to the target's cache: K + 1, or a tree's nodes;
    +ngram adds at most K more (the lookup's chain)."""
    lookup = s.num_draft_tokens if s.ngram_hybrid else 0
    tree = tree_choice(drafter, s)
    paths = [] if tree is None or tree[1] == "dynamic" else tree[1]
    if drafter.kind == "eagle3":  # any tree the draft may grow: its cache is sized once per run
        return max(s.num_draft_tokens, s.dynamic_nodes - 1, len(paths)) + 1 + lookup
    return max(s.num_draft_tokens, len(paths)) + 1 + lookup


def _chain(target: CachedLM, proposer, s: DecodeSettings, k: int | None = None) -> ChainDecoder:
    return ChainDecoder(target, proposer, num_draft_tokens=s.num_draft_tokens if k is None else k,
                        temperature=s.temperature, top_p=s.top_p, eos_token_ids=s.eos_token_ids,
                        generator=s.generator, record_margins=s.record_margins)


def _plain(target, drafter, s):
    return _chain(target, NoProposer(target.device), s, k=0)


def _draft_proposer(target, drafter, s) -> Proposer:
    """A draft LM's chain proposer: sequential, or parallel (one forward) when it has a pard_token."""
    vocab = output_vocab_size(target.model)
    if drafter.kind == "parallel_draft":
        return ParallelDraftProposer(drafter.model, vocab, drafter.info["pard_token"], s.temperature, s.top_p,
                                     s.generator, parallel_tokens=drafter.info.get("parallel_tokens"))
    return DraftModelProposer(drafter.model, vocab, s.temperature, s.top_p, s.generator, s.num_draft_tokens)


def _draft_lm(target, drafter, s):
    return _chain(target, _draft_proposer(target, drafter, s), s)


def _ngram(target, drafter, s):
    return _chain(target, NgramProposer(target.device, max_ngram=s.ngram_max), s)


def _oracle(target, drafter, s):
    oracle = OracleProposer(drafter.model, drafter.info["alpha"], drafter.info.get("vocab", target.vocab_size),
                            target.device, seed=drafter.info.get("seed", 0))
    return _chain(target, oracle, s)


def _medusa(target, drafter, s):
    return medusa_decoder(target, drafter.model, tree=tree_choice(drafter, s)[1],
                          temperature=s.temperature, top_p=s.top_p, eos_token_ids=s.eos_token_ids,
                          generator=s.generator, record_margins=s.record_margins)


def _eagle3(target, drafter, s):
    tree = tree_choice(drafter, s)
    return eagle3_decoder(target, drafter.model, num_draft_tokens=s.num_draft_tokens,
                          tree="chain" if tree is None else tree[1], tree_nodes=s.dynamic_nodes, tree_topk=s.tree_topk,
                          temperature=s.temperature, top_p=s.top_p, eos_token_ids=s.eos_token_ids,
                          generator=s.generator, record_margins=s.record_margins)


DRAFTERS: dict[str, Callable[[CachedLM, Drafter, DecodeSettings], Decoder]] = {
    "none": _plain,
    "draft": _draft_lm,
    "parallel_draft": _draft_lm,
    "ngram": _ngram,
    "oracle": _oracle,
    "medusa": _medusa,
    "eagle3": _eagle3,
}


def build_decoder(target, drafter: Drafter, settings: DecodeSettings) -> Decoder:
    """The decoder of `drafter` verifying with `target` (a cached LM, or an HF model on the eager
    engine). Its `tree_name` says which tree it verifies (None for a chain). With +ngram the
    drafter's own decoder is built first and its drafter joined to n-gram lookup (`hybrid_decoder`)."""
    if drafter.kind not in DRAFTERS:
        raise ValueError(f"unknown drafter kind {drafter.kind!r}; known: {', '.join(DRAFTERS)}")
    if settings.ngram_hybrid and (drafter.kind not in HYBRID_KINDS or settings.temperature > 0):
        raise ValueError(f"+ngram joins n-gram lookup to a model drafter ({', '.join(HYBRID_KINDS)}) in one tree, "
                         f"greedy only; not {drafter.kind} at temperature {settings.temperature}")
    decoder = DRAFTERS[drafter.kind](as_cached_lm(target), drafter, settings)
    if settings.ngram_hybrid:
        decoder = hybrid_decoder(decoder, settings.ngram_max)
    decoder.tree_name = tree_name(drafter, settings)
    return decoder
