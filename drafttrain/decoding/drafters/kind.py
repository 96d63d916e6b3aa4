"""What a drafter kind declares, once, in its own file (`KIND = DrafterKind(...)`), so that the
factory, `eval`/`compare`, the planner, the reports and the vLLM backend read it instead of naming
the kind: a new kind is its file plus one line in `drafters.REGISTRY`.

Every field but `name` and `build` is optional: a kind without a flag is not offered on the
command line (the oracle), one without `tree` drafts a chain, one without `lookup` cannot be
hung from a model drafter's tree (`+ngram`), one without `vllm` cannot be served, one without
`replay` is not offered by `drafttrain replay`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Drafter:
    """A loaded drafter: its kind (a `DrafterKind.name`), its model (a draft LM, sequential or
    parallel with `info["pard_token"]`, or its cached LM, Medusa heads, an EAGLE-3 draft or its
    cached draft, an oracle's references; None for lookups and plain decoding) and what its
    export recorded (`info`: e.g. the heads' calibrated tree)."""

    kind: str
    model: object = None
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DrafterKind:
    """One drafter kind. Callables take the loaded `Drafter` `d` and the run's `DecodeSettings` `s`."""

    name: str                                   # Drafter.kind, the report's kind
    build: Callable                             # (target CachedLM, d, s) -> Decoder
    drafts: bool = True                         # False: the target alone (K = 0), the baseline
    flag: str | None = None                     # eval's flag and compare's prefix for an export: --draft DIR
    method: bool = False                        # a drafter without weights: --method NAME, compare NAME=NAME
    help: str = ""                              # the flag's --help text, or the method's description
    label: str = ""                             # what reports call a lookup's branch: "n-gram"
    load: Callable | None = None                # (path, target, tokenizer, device, dtype) -> d, checked
    bind: Callable | None = None                # (d, target_lm, engine, k, nodes, topk) -> d on its engine
    tree: Callable | None = None                # (d, s) -> (name, paths | "dynamic") | None for a chain
    tree_vocab: Callable | None = None          # d -> (vocabulary a tree's choices index, whose)
    depth_limit: Callable | None = None         # d -> the deepest tree it drafts (Medusa: its heads)
    grows_trees: bool = False                   # its cache is sized for any tree it may grow
    takes_lookup: bool = False                  # joins a lookup's chain to its own (+ngram), greedy
    lookup: Callable | None = None              # s -> a `LookupProposer`: hung from a model's tree
    planned_from_walks: bool = False            # greedy acceptance walked over calibration outputs
    step_seconds: Callable | None = None        # (d, target_lm, ids, max_k, acceptance) -> [s_0 .. s_max_k], noise
    draft_forwards: Callable | None = None      # (d, max_k, acceptance) -> [(forwards, tokens each)] per k
    cost_ratio: Callable | None = None          # (d, target_lm, ids, k) -> a step's cost in target forwards
    report: Callable | None = None              # (d, decoder, overall) -> report blocks of this kind
    report_note: Callable | None = None         # report dict -> report.md's lines on this kind's block
    gpu_costs: Callable | None = None           # (d, target, max_k) -> a step's cost drafting 0 .. max_k, in
                                                # target forwards, on a GPU at batch 1 (its parameter share)
    vllm: Callable | None = None                # (path, k, d, s) -> vLLM's speculative_config
    vllm_forwards: Callable | None = None       # (k, d) -> the drafter's forwards per served step
    sglang: str | None = None                   # SGLang's --speculative-algorithm for its export, if it serves it
    replay: str | None = None                   # how `replay` scores its export's greedy acceptance from one
                                                # forward: "tokens" (its own, a draft LM) or "features" (the
                                                # target's hidden states); None: not replayed
    replay_default: bool = False                # `replay --draft NAME=DIR` (no FLAG: prefix) loads this kind
    served_note: str = ""                       # why vLLM's acceptance may differ from ours (no export involved)

    def tree_choice(self, drafter: Drafter, s) -> tuple[str, list | str] | None:
        return self.tree(drafter, s) if self.tree is not None else None


def chain_decoder(target, proposer, s, k: int | None = None):
    """A chain decoder of `proposer` with the run's settings (K drafts, or `k`)."""
    from ..chain import ChainDecoder

    return ChainDecoder(target, proposer, num_draft_tokens=s.num_draft_tokens if k is None else k,
                        rule=s.rule(), eos_token_ids=s.eos_token_ids, record_margins=s.record_margins)


def require_finite(module, what: str, path: str) -> None:
    """A loaded drafter's weights are all finite, or one `error:` line: the file is damaged."""
    import torch

    from ...errors import UserError

    bad = next((name for name, p in module.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if bad is not None:
        raise UserError(f"the {what} at {path!r} has non-finite weights (NaN or inf in {bad}); the file is damaged: "
                        "export it again")


def parameter_share(module, target, skip: str = "") -> float:
    """`module`'s parameters (but those whose name holds `skip`) over the target's."""
    own = sum(p.numel() for name, p in module.named_parameters() if not skip or skip not in name)
    return own / sum(p.numel() for p in target.parameters())


def per_token(one: float, max_k: int) -> list[float]:
    """A drafter that runs one forward per draft token: k of them for k drafts."""
    return [k * one for k in range(max_k + 1)]


__all__ = ["Drafter", "DrafterKind", "chain_decoder", "parameter_share", "per_token", "require_finite"]
