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


class SpeculativeDecoder:
    def __init__(self, target, proposer: Proposer, *, num_draft_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, eos_token_ids: set[int] = frozenset(),
                 generator: torch.Generator | None = None):
        self.target = CachedLM(target)
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
        out = Generation()
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
            if self.temperature == 0:
                verdict = verify_greedy(draft, logits)
            else:
                p = probabilities(logits, self.temperature, self.top_p)
                verdict = verify_sampled(draft, q, p, self.generator)
            verdict = verdict.tolist()  # the one host sync of the step
            n = verdict[0]
            emitted = verdict[1:n + 2]
            self.target.rollback(self.target.length - (draft.numel() - n))
            self.proposer.commit(n, emitted)
            for i, token in enumerate(emitted):  # stop at the first EOS, included
                if token in self.eos:
                    emitted = emitted[:i + 1]
                    break
            out.tokens.extend(emitted)
            out.accepted_lengths.append(min(n, len(emitted)))
            out.proposed_lengths.append(draft.numel())
            out.step_tokens.append(len(emitted))
            out.step_seconds.append(time.perf_counter() - step_start)
            sequence.extend(emitted)
            if emitted[-1] in self.eos:
                break
            pending = torch.tensor(emitted[-1:], dtype=torch.long, device=self.device)
        return out
