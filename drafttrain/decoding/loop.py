"""The decode loop every decoder shares (batch size 1).

Invariant: the target's KV cache holds the whole sequence except its last token (`pending`).
Each step sends `pending` plus the step's drafts through the target in ONE forward pass (a chain
or a tree), keeps the accepted tokens' cache entries, and the newly emitted last token becomes
`pending`. Prefill therefore covers prompt[:-1], and every emitted token comes out of a
verification pass: with no drafts the same loop is plain decoding (tau exactly 1).

What differs between decoders is one step (`_step`): how drafts are made and verified. The
bookkeeping around it is written once, here: reset and prefill, the loop bounded by
max_new_tokens, the EOS trim, counted proposals, the `Generation` record. A step syncs with the
host exactly once (to learn how many tokens it accepted); everything else stays queued on the
device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..tokens import cut_at_eos
from .engines import CachedLM, as_cached_lm, device_tensor, synchronize
from .verify import Greedy, Sampled, acceptance_rule, top2_margins


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)          # continuation only, EOS included
    accepted_lengths: list[int] = field(default_factory=list)  # per verification step
    proposed_lengths: list[int] = field(default_factory=list)  # drafts proposed per step
    step_seconds: list[float] = field(default_factory=list)    # wall time of each step
    step_tokens: list[int] = field(default_factory=list)       # tokens emitted by each step
    prefill_seconds: float = 0.0
    # Greedy decoders asked to record them: the target's top-1 minus top-2 logit behind each
    # emitted token, which tells a near-tie (numerics may flip it) from a real disagreement.
    margins: list[float] | None = None
    draft_forwards: int = 0  # the drafter's model forwards (a parallel draft or heads: one per step)
    # False where the steps are not in time order (a served run whose steps that drafted nothing
    # vLLM did not record): per-window figures cannot place them (`evaluation.windows`).
    steps_in_order: bool = True


@dataclass
class Step:
    """What one verification step decided (on the host, after its one sync)."""

    accepted: list[int]              # draft tokens the target accepted
    bonus: int                       # the target's own token after them
    proposed: int                    # draft positions proposed (a tree's depth, a chain's length)
    margins: list[float] | None = None  # per emitted token: top-1 minus top-2 target logit


def counted_proposals(proposed: int, emitted: list[int], eos: set[int]) -> int:
    """Drafts proposed past an EOS that ended the generation were never in play: not counted.

    `emitted` is the step's output cut at its first EOS (`tokens.cut_at_eos`). If it ends with an EOS at (1-based)
    position p, draft positions beyond p are past the end: a draft identical to the target then
    has acceptance 1.0 (its p-th draft was the EOS itself, or the target's EOS rejected it).
    """
    if emitted and emitted[-1] in eos:
        return min(proposed, len(emitted))
    return proposed


class Decoder:
    """Base of the chain (`ChainDecoder`) and tree (`TreeDecoder`) decoders.

    `target`: a `CachedLM` (any engine) or a plain HF model (run on the eager engine).
    """

    name = "decoder"
    verdict = None  # a greedy verdict run in the target's verification graph (`verify.GreedyVerdict`)

    def __init__(self, target, *, temperature: float = 0.0, top_p: float = 1.0,
                 eos_token_ids: set[int] = frozenset(), generator: torch.Generator | None = None,
                 record_margins: bool = False, rule: Greedy | Sampled | None = None):
        """`rule`: the acceptance rule (`verify.Greedy` or `verify.Sampled`; unset: the one of
        `temperature`, `top_p` and `generator`). `record_margins` (greedy only): keep the
        target's top-1 minus top-2 logit behind every emitted token in `Generation.margins`."""
        self.rule = rule if rule is not None else acceptance_rule(temperature, top_p, generator)
        if record_margins and not self.rule.greedy:
            raise ValueError("margins are recorded for greedy decoding only")
        self.target: CachedLM = as_cached_lm(target)
        self.device = self.target.device
        self.eos = set(eos_token_ids)
        self.record_margins = record_margins
        self.pending: torch.Tensor | None = None  # [1] on the device: the last token, not yet cached
        self.sequence: list[int] = []             # prompt + emitted tokens

    # -- what a decoder declares ------------------------------------------------------------------

    @property
    def num_draft_tokens(self) -> int:
        """K: the most draft positions one step can accept."""
        raise NotImplementedError

    @property
    def num_tree_nodes(self) -> int:
        """Tokens one full verification forward processes (pending included)."""
        return self.num_draft_tokens + 1

    def drafting(self):
        """The decoder's drafter (a `chain.Proposer` or a `tree.TreeDrafter`); None: plain decoding."""
        return None

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target hidden layers the drafter reads (transformers' `output_hidden_states` indexing)."""
        return tuple(getattr(self.drafting(), "hidden_layers", ()))

    def step_sizes(self) -> list[int]:
        """Target forward sizes the steps use (the static engine's buckets)."""
        return [1] if self.num_draft_tokens == 0 else sorted({1, 2, self.num_draft_tokens + 1})

    def target_shapes(self) -> dict:
        """The target's warm-up options besides its step sizes, hidden layers and verdict (a
        tree's: the kept path's width, the tree's depth)."""
        return {}

    def warmup(self) -> float:
        """Compile and capture every shape this decoder's steps use (target and drafter), so no
        timed step ever compiles. Returns the seconds spent (0 on the eager engine). The target
        first: a drafter may read what it registered (`MedusaDrafter.warmup`)."""
        seconds = self.target.warmup(self.step_sizes(), hidden_layers=self.hidden_layers, verdict=self.verdict,
                                     **self.target_shapes())
        drafter = self.drafting()
        return seconds + (drafter.warmup() if drafter is not None else 0.0)

    # -- the loop --------------------------------------------------------------------------------

    def _start(self, prompt: list[int], hidden: torch.Tensor | None) -> None:
        """After prefill: reset the drafter (`hidden`: the prefill's hidden states, or None)."""

    def _step(self, budget: int) -> Step:
        """One verification step emitting at most `budget` tokens; sets `self.pending`."""
        raise NotImplementedError

    def drafter_forwards(self) -> int:
        """The drafter's model forwards so far (0 for lookups and plain decoding)."""
        drafter = self.drafting()
        return drafter.forwards if drafter is not None else 0

    def generate(self, prompt: list[int], max_new_tokens: int) -> Generation:
        out = Generation(margins=[] if self.record_margins else None)
        forwards = self.drafter_forwards()
        start = time.perf_counter()
        self.target.reset()
        prompt_t = device_tensor(list(prompt), self.device)
        hidden = None
        if len(prompt) > 1:
            hidden = self.target.prefill(prompt_t[:-1], hidden_layers=self.hidden_layers)
        self.pending = prompt_t[-1:]
        self.sequence = list(prompt)
        self._start(list(prompt), hidden)
        synchronize(self.device)
        out.prefill_seconds = time.perf_counter() - start

        while len(out.tokens) < max_new_tokens:
            step_start = time.perf_counter()
            step = self._step(max_new_tokens - len(out.tokens))
            emitted = cut_at_eos(step.accepted + [step.bonus], self.eos)
            out.tokens.extend(emitted)
            if out.margins is not None:
                out.margins.extend(step.margins[:len(emitted)])
            out.accepted_lengths.append(min(len(step.accepted), len(emitted)))
            out.proposed_lengths.append(counted_proposals(step.proposed, emitted, self.eos))
            out.step_tokens.append(len(emitted))
            out.step_seconds.append(time.perf_counter() - step_start)
            self.sequence.extend(emitted)
            if emitted[-1] in self.eos:
                break
        out.draft_forwards = self.drafter_forwards() - forwards
        return out


__all__ = ["Decoder", "Generation", "Step", "counted_proposals", "top2_margins"]
