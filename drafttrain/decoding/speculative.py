"""The speculative decode loop (batch size 1).

Invariant: the target's KV cache holds the whole sequence except its last token (`pending`).
Each step sends [pending, d_1..d_k] through the target in ONE forward pass; the logits at those
k+1 positions score every draft and give the bonus token. The cache then keeps pending plus the
accepted drafts, and the newly emitted last token becomes pending. Prefill therefore covers
prompt[:-1], and every emitted token comes out of a verification pass: with no drafts the
same loop is plain decoding (mean accepted length exactly 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cache import CachedLM
from .proposers import Proposer
from .sampling import probabilities, verify_greedy, verify_sampled


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


def trim_at_eos(emitted: list[int], eos: set[int]) -> list[int]:
    """A step's emitted tokens up to the first EOS, included."""
    for i, token in enumerate(emitted):
        if token in eos:
            return emitted[:i + 1]
    return emitted


def counted_proposals(proposed: int, emitted: list[int], eos: set[int]) -> int:
    """Drafts proposed past an EOS that ended the generation were never in play: not counted.

    `emitted` is the step's output after `trim_at_eos`. If it ends with an EOS at (1-based)
    position p, draft positions beyond p are past the end: a draft identical to the target then
    has acceptance 1.0 (its p-th draft was the EOS itself, or the target's EOS rejected it).
    """
    if emitted and emitted[-1] in eos:
        return min(proposed, len(emitted))
    return proposed


class SpeculativeDecoder:
    def __init__(self, target, proposer: Proposer, *, num_draft_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, eos_token_ids: set[int] = frozenset(),
                 generator: torch.Generator | None = None, record_margins: bool = False):
        """`record_margins` (greedy only): keep the target's top-1 minus top-2 logit behind every
        emitted token in `Generation.margins`."""
        if record_margins and temperature > 0:
            raise ValueError("margins are recorded for greedy decoding only")
        self.target = CachedLM(target)
        self.record_margins = record_margins
        self.proposer = proposer
        self.k = num_draft_tokens if proposer.name != "none" else 0
        self.temperature, self.top_p = temperature, top_p
        self.eos = set(eos_token_ids)
        self.generator = generator
        self.device = next(target.parameters()).device

    @property
    def num_draft_tokens(self) -> int:
        return self.k

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate(self, prompt: list[int], max_new_tokens: int) -> Generation:
        out = Generation(margins=[] if self.record_margins else None)
        start = time.perf_counter()
        self.target.reset()
        self.proposer.reset(prompt)
        if len(prompt) > 1:
            self.target.forward(torch.tensor(prompt[:-1], dtype=torch.long, device=self.device))
        pending = torch.tensor(prompt[-1:], dtype=torch.long, device=self.device)
        sequence = list(prompt)
        self._sync()
        out.prefill_seconds = time.perf_counter() - start

        while len(out.tokens) < max_new_tokens:
            step_start = time.perf_counter()
            # Never draft more than can be emitted: at most k drafts + 1 token per step.
            k = min(self.k, max_new_tokens - len(out.tokens) - 1)
            draft, q = self.proposer.propose(k, sequence)
            logits = self.target.forward(torch.cat([pending, draft]))
            margins = None
            if self.temperature == 0:
                verdict = verify_greedy(draft, logits)
                if self.record_margins:  # token ids are exact in float64: still one sync
                    top2 = logits.topk(2, dim=-1).values.double()
                    verdict = torch.cat([verdict.double(), top2[:, 0] - top2[:, 1]])
            else:
                p = probabilities(logits, self.temperature, self.top_p)
                verdict = verify_sampled(draft, q, p, self.generator)
            verdict = verdict.tolist()  # the one host sync of the step
            n = int(verdict[0])
            emitted = [int(t) for t in verdict[1:n + 2]]
            if self.record_margins:
                margins = verdict[draft.numel() + 2:]
            self.target.rollback(self.target.length - (draft.numel() - n))
            self.proposer.commit(n, emitted)
            emitted = trim_at_eos(emitted, self.eos)
            out.tokens.extend(emitted)
            if margins is not None:
                out.margins.extend(margins[:len(emitted)])
            out.accepted_lengths.append(min(n, len(emitted)))
            out.proposed_lengths.append(counted_proposals(draft.numel(), emitted, self.eos))
            out.step_tokens.append(len(emitted))
            out.step_seconds.append(time.perf_counter() - step_start)
            sequence.extend(emitted)
            if emitted[-1] in self.eos:
                break
            pending = torch.tensor(emitted[-1:], dtype=torch.long, device=self.device)
        return out
