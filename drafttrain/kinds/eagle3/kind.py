"""EAGLE-3's declaration (`KIND`, `--eagle3 DIR`): loading, binding its cache beside the target's
engine, its tree (static or dynamic), costs, serving and `replay`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...decoding.chain import ChainDecoder
from ...decoding.engines import CachedLM
from ...decoding.timing import single_token_seconds
from ...decoding.tree import TreeDecoder
from ...trees import resolve_tree
from ..base import BENCH_TREE_NODES, Drafter, DrafterKind, parameter_share, per_token, replayed_sequence, require_finite
from .decode import (Eagle3Proposer, Eagle3Runtime, Eagle3TreeDrafter, eagle3_decoder, eagle3_runtime,
                     eagle3_step_seconds)
from .model import Eagle3Draft

if TYPE_CHECKING:
    from ...decoding.settings import DecodeSettings
    from ...decoding.loop import Decoder


class Eagle3Kind(DrafterKind):
    """An EAGLE-3 draft reading the target's features (`--eagle3 DIR`): a chain or EAGLE-2's tree."""

    name, flag = "eagle3", "eagle3"
    help = "EAGLE-3 draft directory (SGLang's / vLLM's layout) trained on this target."
    grows_trees, takes_lookup, sglang = True, True, "EAGLE3"

    def build(self, target: CachedLM, d: Drafter, s: DecodeSettings) -> ChainDecoder | TreeDecoder:
        """`eagle3_decoder` of the draft on its engine with its tree (`tree`; None: a chain) and the run's rule."""
        tree = self.tree(d, s)
        return eagle3_decoder(target, self._runtime(d, target, s), num_draft_tokens=s.num_draft_tokens,
                              tree="chain" if tree is None else tree[1], tree_nodes=s.dynamic_nodes,
                              tree_topk=s.tree_topk, rule=s.rule(), eos_token_ids=s.eos_token_ids,
                              record_margins=s.record_margins)

    def load(self, path: str | None, target: torch.nn.Module, tokenizer: object, device: torch.device,
             dtype: torch.dtype) -> Drafter:
        """An EAGLE-3 draft checked against the target, reading the target's embeddings."""
        from .export import load_eagle3

        draft, info = load_eagle3(path, device=device, dtype=dtype, target_config=target.config)
        require_finite(draft, "EAGLE-3 draft", path)
        draft.attach_embeddings(target.get_input_embeddings())
        draft.eval()
        return Drafter("eagle3", draft, {"aux_layer_ids": list(info.aux_layer_ids),
                                         "draft_vocab_size": info.draft_vocab_size,
                                         **(info.config.get("drafttrain") or {})})

    def bind(self, d: Drafter, target_lm: CachedLM, engine: str, max_length: int, s: DecodeSettings) -> Drafter:
        """The draft's run time follows the target: static (compiled) beside static."""
        return Drafter(d.kind, self._runtime(d, target_lm, s), d.info)

    def _runtime(self, d: Drafter, target_lm: CachedLM | None = None, s: DecodeSettings | None = None
                 ) -> Eagle3Runtime:
        """`d`'s run time: the one `bind` made, else one made here (a draft no run bound: a test's,
        `bench`'s): beside `target_lm`, sized for the settings `s`; without them on the eager engine."""
        if isinstance(d.model, Eagle3Runtime):
            return d.model
        if s is None:
            return Eagle3Runtime(d.model)
        return eagle3_runtime(target_lm, d.model, num_draft_tokens=s.num_draft_tokens, tree_nodes=s.dynamic_nodes,
                              tree_topk=s.tree_topk)

    def tree(self, d: Drafter, s: DecodeSettings) -> tuple[str, list | str] | None:
        """Greedy: EAGLE-2's dynamic tree unless --tree names another (auto: dynamic); sampling and
        --tree chain draft a chain (None)."""
        if s.temperature > 0 or s.tree == "chain":
            return None
        name, paths = resolve_tree(s.tree, s.num_draft_tokens, auto="dynamic", nodes=s.tree_nodes)
        return (f"dynamic ({s.dynamic_nodes} nodes, top-{s.tree_topk})" if paths == "dynamic" else name), paths

    def tree_vocab(self, d: Drafter) -> tuple[int, str]:
        """The draft's reduced vocabulary: a tree's choices index its top-k."""
        return d.model.config.draft_vocab_size, "the EAGLE-3 draft's"

    def step_seconds(self, d: Drafter, target_lm: CachedLM, ids: list[int], max_k: int, acceptance: list[float],
                     repeats: int) -> tuple[list[float], list[str]]:
        """A chain: one pass of the draft layer per draft token."""
        return per_token(eagle3_step_seconds(self._runtime(d), target_lm, ids, repeats), max_k), []

    def draft_forwards(self, d: Drafter, max_k: int, acceptance: list[float]) -> list[tuple[int, int]]:
        """k passes of one token each to draft k."""
        return [(k, 1) for k in range(1, max_k + 1)]

    def cost_ratio(self, d: Drafter, target_lm: CachedLM, ids: list[int], k: int) -> float:
        """One pass of the draft layer over one target forward."""
        return eagle3_step_seconds(self._runtime(d), target_lm, ids) / single_token_seconds(target_lm, ids)

    def gpu_costs(self, d: Drafter, target: torch.nn.Module, max_k: int) -> list[float]:
        """One pass per draft token, each its share of the target's parameters (the shared embeddings aside)."""
        return per_token(parameter_share(d.model, target, skip="embed"), max_k)

    def report(self, d: Drafter, decoder: Decoder, overall: dict) -> dict:
        """A dynamic tree's nodes; the draft's export record."""
        if overall.get("tree", "").startswith("dynamic"):
            overall["tree_nodes"] = decoder.num_tree_nodes
        return {"eagle3": d.info} if d.info else {}

    def bench_rows(self, target: torch.nn.Module, k: int, max_length: int) -> list[tuple[str, Drafter, dict]]:
        """A fresh draft over half the target's vocabulary: a chain, EAGLE-2's dynamic tree, and that tree
        with n-gram lookup's branch."""
        from ..vocab import build_draft_vocab

        size = target.config.vocab_size
        vocab = build_draft_vocab([list(range(size))], size, size // 2)
        aux = tuple(range(1, target.config.num_hidden_layers))
        drafter = Drafter(self.name, Eagle3Draft.from_target(target, vocab, aux, dtype=target.dtype, seed=0))
        dynamic = dict(tree="dynamic", tree_nodes=BENCH_TREE_NODES, tree_topk=4)
        return [("EAGLE-3 chain", drafter, {"tree": "chain"}), ("EAGLE-3 dynamic tree", drafter, dynamic),
                ("EAGLE-3 tree + n-gram", drafter, {**dynamic, "hybrid": "ngram"})]

    def vllm(self, path: str | None, k: int, d: Drafter, s: DecodeSettings | None) -> dict:
        """vLLM's EAGLE-3 with the draft at `path`."""
        return {"method": "eagle3", "model": path, "num_speculative_tokens": k}

    def vllm_forwards(self, k: int, d: Drafter) -> int:
        """One draft pass per draft token."""
        return k


    @torch.no_grad()
    def replay_matches(self, d: Drafter, target: torch.nn.Module, prompt: list[int], target_tokens: list[int],
                       k: int) -> list[list[bool]]:
        """The grid from ONE forward of the `target` (its features) and ONE K-step unroll of the draft (the
        target's embedding attached) over (prompt + the target's greedy output), draft j of a step being
        unroll step j.

        A step that begins with t output tokens emitted (sequence length c = P + t, the draft's cache
        holding indices 0..c-2) drafts its token j with unroll step j at index c - 2: step 0 reads the
        target's features there and the pending token, step j >= 1 its own previous hidden state and
        the next token of the sequence, which IS its own previous draft whenever that was accepted
        (and after a rejection nothing later counts). A one-token prompt's first step has no index to
        draft from: it proposes nothing, as the decoder does."""
        if not target_tokens:
            return []
        draft = d.model
        sequence, ids = replayed_sequence(draft, prompt, target_tokens)
        hidden_states = target(input_ids=ids, output_hidden_states=True, logits_to_keep=1).hidden_states
        first = max(len(prompt) - 2, 0)  # the first index a step drafts from
        steps = max(k, 1)
        logits = draft(draft.target_features(hidden_states), ids, num_steps=steps, logits_from=first)
        guesses = draft.to_target_ids(logits[:, 0].argmax(-1)).T.tolist()  # [index - first][step]
        rows = []
        for t in range(len(target_tokens)):
            c = len(prompt) + t
            rows.append([] if c < 2 else [c + j < len(sequence) and guesses[c - 2 - first][j] == sequence[c + j]
                                          for j in range(steps)])
        return rows


KIND = Eagle3Kind()

__all__ = ["KIND", "Eagle3Runtime", "eagle3_decoder", "Eagle3Proposer", "Eagle3TreeDrafter", "eagle3_runtime",
           "eagle3_step_seconds"]
