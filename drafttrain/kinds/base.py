"""What a drafter kind declares, once, in its folder's `kind.py` (`class NgramKind(DrafterKind)`, then
`KIND = NgramKind()`), so that the factory, `eval`/`compare`, the planner, the reports and the vLLM
backend read it instead of naming the kind: a new kind is its folder plus one line in
`kinds.registry.KINDS`.

A kind sets the class attributes it has and overrides `build` and the methods it has; the rest keep
the base's defaults, which mean "none" (`supports(name)` tells a method of its own from a default):
a kind without a flag is not offered on the command line (the oracle), one without `tree` drafts a
chain, one without `lookup` cannot be hung from a model drafter's tree (`+ngram`), one without
`vllm` cannot be served, one without `replay_matches` is not offered by `drafttrain replay`, one without
`bench_rows` has no row in `bench`'s step-overhead table, one without `settings` adds no flag of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..decoding.chain import Proposer
    from ..decoding.engines import CachedLM
    from ..decoding.settings import DecodeSettings
    from ..decoding.loop import Decoder


@dataclass
class Drafter:
    """A loaded drafter: its kind (a `DrafterKind.name`), its model (a draft LM, sequential or
    parallel with `info["pard_token"]`, or its cached LM, Medusa heads, an EAGLE-3 draft or its
    run time, an oracle's references; None for lookups and plain decoding) and what its export
    recorded (`info`: e.g. the heads' calibrated tree)."""

    kind: str
    model: object = None
    info: dict = field(default_factory=dict)


BENCH_TREE_NODES = 16  # `bench`'s step-overhead rows: a dynamic tree's nodes


class DrafterKind:
    """One drafter kind: a subclass per kind sets the class attributes it has and overrides `build`
    and the methods it has. Methods take the loaded `Drafter` `d` and the run's `DecodeSettings` `s`."""

    name: str = ""                      # Drafter.kind, the report's kind
    drafts: bool = True                 # False: the target alone (K = 0), the baseline
    flag: str | None = None             # eval's flag and compare's prefix for an export: --draft DIR
    method: bool = False                # a drafter without weights: --method NAME, compare NAME=NAME
    help: str = ""                      # the flag's --help text, or the method's description
    label: str = ""                     # what reports call a lookup's branch: "n-gram"
    grows_trees: bool = False           # its cache is sized for any tree it may grow
    takes_lookup: bool = False          # joins a lookup's chain to its own (+ngram), greedy
    planned_from_walks: bool = False    # greedy acceptance walked over calibration outputs
    sglang: str | None = None           # SGLang's --speculative-algorithm for its export, if it serves it
    replay_default: bool = False        # `replay --draft NAME=DIR` (no FLAG: prefix) loads this kind
    served_note: str = ""               # why vLLM's acceptance may differ from ours (no export involved)

    def supports(self, name: str) -> bool:
        """Whether this kind has its own `name` method, not the base's "has none" ("vllm": it is served)."""
        default = DrafterKind.__dict__.get(name)
        if not callable(default) or name in ("build", "drafter", "supports", "value"):
            raise AttributeError(f"DrafterKind has no optional method {name!r}")
        return getattr(type(self), name) is not default

    def settings(self) -> dict[str, tuple[str, object]]:
        """Settings of its own, by field name: (annotation, `config.setting(...)`), each one an `eval`/`compare`
        flag (`--ngram-max N`) and a value in `DecodeSettings.kind_settings` (read with `value`); none by default."""
        return {}

    def value(self, s: DecodeSettings | None, name: str) -> object:
        """Its setting `name` (one of `settings`) under `s`: the run's value, else (unset, or no `s`) its default."""
        if s is not None and name in s.kind_settings:
            return s.kind_settings[name]
        return self.settings()[name][1].default

    def drafter(self, model: object, info: dict | None = None) -> Drafter:
        """`model` (just trained, or an export's config as `.config`) as this kind decodes it, with `info`."""
        return Drafter(self.name, model, info or {})

    def build(self, target: CachedLM, d: Drafter, s: DecodeSettings) -> Decoder:
        """The decoder of `d` on `target` with the run's settings: what every kind must have."""
        raise NotImplementedError(f"drafter kind {self.name!r} builds no decoder")

    def load(self, path: str | None, target: torch.nn.Module, tokenizer: object, device: torch.device,
             dtype: torch.dtype) -> Drafter:
        """The drafter from its export at `path`, checked against the target; without weights, nothing to load."""
        return Drafter(self.name)

    def bind(self, d: Drafter, target_lm: CachedLM, engine: str, max_length: int, s: DecodeSettings) -> Drafter:
        """`d` on its engine beside `target_lm` (a draft LM on its own cached LM); unchanged without a model."""
        return d

    def tree(self, d: Drafter, s: DecodeSettings) -> tuple[str, list | str] | None:
        """The tree it drafts under `s`, as (name, paths or "dynamic"); None: a chain."""
        return None

    def tree_vocab(self, d: Drafter) -> tuple[int, str] | None:
        """(size, whose) of the vocabulary its tree's choices index, to check a tree fits; None: no tree."""
        return None

    def depth_limit(self, d: Drafter) -> int | None:
        """The deepest it can draft (Medusa: its heads); None: no limit of its own."""
        return None

    def lookup(self, s: DecodeSettings) -> Proposer | None:
        """A lookup proposer to hang from a model drafter's tree (+NAME); None: not a lookup."""
        return None

    def step_seconds(self, d: Drafter, target_lm: CachedLM, ids: list[int], max_k: int, acceptance: list[float],
                     repeats: int) -> tuple[list[float], list[str]]:
        """Its step's seconds drafting k = 0 .. max_k after `ids`, and noise warnings, for the planner; 0: no model."""
        return [0.0] * (max_k + 1), []

    def draft_forwards(self, d: Drafter, max_k: int, acceptance: list[float]) -> list[tuple[int, int]] | None:
        """(forwards, tokens each) it runs drafting k = 1 .. max_k, to flag implausible timings; None: no model."""
        return None

    def cost_ratio(self, d: Drafter, target_lm: CachedLM, ids: list[int], k: int) -> float:
        """A draft token's cost in target forwards, for the report; 0 without a model."""
        return 0.0

    def gpu_costs(self, d: Drafter, target: torch.nn.Module, max_k: int) -> list[float]:
        """A step's cost drafting 0 .. max_k, in target forwards, on a GPU at batch 1 (its parameters); 0: no model."""
        return [0.0] * (max_k + 1)

    def report(self, d: Drafter, decoder: Decoder, overall: dict) -> dict:
        """Report blocks of this kind (it may also add to `overall`), e.g. its export's record; none by default."""
        return {}

    def report_note(self, report: dict) -> list[str]:
        """report.md's lines on this kind's block of `report`; none by default."""
        return []

    def vllm(self, path: str | None, k: int, d: Drafter, s: DecodeSettings | None) -> dict | None:
        """vLLM's `speculative_config` serving it at K = `k` drafts a step; None: vLLM cannot serve it."""
        return None

    def vllm_forwards(self, k: int, d: Drafter) -> int:
        """The drafter's forwards per step vLLM serves at K = `k`; 0 without a model."""
        return 0

    def bench_rows(self, target: torch.nn.Module, k: int, max_length: int) -> list[tuple[str, Drafter, dict]]:
        """`bench`'s step-overhead rows: (label, a random drafter for the tiny `target`, settings); none by default."""
        return []

    def replay_matches(self, d: Drafter, target: torch.nn.Module, prompt: list[int], target_tokens: list[int],
                       k: int) -> list[bool] | list[list[bool]]:
        """`replay`'s greedy acceptance of `d` from one forward over (prompt + the target's greedy output),
        as `evaluation.replay.chain_steps` reads it: whether its draft equals the target's token at each output
        position, or a grid (per step start t, per draft j < K = `k`); not replayed by default."""
        raise NotImplementedError(f"drafter kind {self.name!r} is not replayed")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def chain_decoder(target, proposer, s, k: int | None = None, rule=None):
    """A chain decoder of `proposer` with the run's settings (K drafts, or `k`). `rule`: the one
    the proposer picks its drafts with (`rule.pick`), so that both read one generator; None: the
    settings' (`s.rule()`)."""
    from ..decoding.chain import ChainDecoder

    return ChainDecoder(target, proposer, num_draft_tokens=s.num_draft_tokens if k is None else k,
                        rule=rule or s.rule(), eos_token_ids=s.eos_token_ids, record_margins=s.record_margins)


def require_finite(module, what: str, path: str) -> None:
    """A loaded drafter's weights are all finite, or one `error:` line: the file is damaged."""
    import torch

    from ..errors import UserError

    bad = next((name for name, p in module.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if bad is not None:
        raise UserError(f"the {what} at {path!r} has non-finite weights (NaN or inf in {bad}); the file is damaged: "
                        "export it again")


def parameter_share(module, target, skip: str = "") -> float:
    """`module`'s parameters (but those whose name holds `skip`) over the target's."""
    own = sum(p.numel() for name, p in module.named_parameters() if not skip or skip not in name)
    return own / sum(p.numel() for p in target.parameters())


def replayed_sequence(model, prompt: list[int], target_tokens: list[int]) -> tuple[list[int], torch.Tensor]:
    """`replay_matches`' input: prompt + the target's output, as a list and as one row of ids on `model`'s device."""
    import torch

    sequence = list(prompt) + list(target_tokens)
    return sequence, torch.tensor([sequence], dtype=torch.long, device=next(model.parameters()).device)


def per_token(one: float, max_k: int) -> list[float]:
    """A drafter that runs one forward per draft token: k of them for k drafts."""
    return [k * one for k in range(max_k + 1)]


__all__ = ["BENCH_TREE_NODES", "Drafter", "DrafterKind", "chain_decoder", "parameter_share", "per_token",
           "replayed_sequence", "require_finite"]
