"""Chain speculative decoding: a proposer drafts up to K tokens, the target verifies them in one pass.

Each step sends [pending, d_1..d_k] through the target; the logits at those k+1 positions score
every draft and give the bonus token. Greedy: the longest draft prefix equal to the target's
argmax. Sampling: the rejection rule of `sampling.verify_sampled` (lossless for any proposer).
The cache then rolls back to pending plus the accepted drafts (on the static engine: moving a
length). A proposer that reads the target's hidden states (`Proposer.hidden_layers`) gets those
of every newly kept position, from the same forward.
"""

from __future__ import annotations

import torch

from .decoder import Decoder, Generation, Step, counted_proposals, top2_margins, trim_at_eos
from .proposers import Proposer
from .sampling import probabilities, verify_greedy, verify_sampled

__all__ = ["SpeculativeDecoder", "Generation", "counted_proposals", "trim_at_eos"]


class SpeculativeDecoder(Decoder):
    name = "chain"

    def __init__(self, target, proposer: Proposer, *, num_draft_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, eos_token_ids: set[int] = frozenset(),
                 generator: torch.Generator | None = None, record_margins: bool = False):
        super().__init__(target, temperature=temperature, top_p=top_p, eos_token_ids=eos_token_ids,
                         generator=generator, record_margins=record_margins)
        self.proposer = proposer
        self.k = num_draft_tokens if proposer.name != "none" else 0

    @property
    def num_draft_tokens(self) -> int:
        return self.k

    @property
    def tree(self) -> list[tuple[int, ...]]:
        """Chain verification as a Medusa tree: (0,), (0, 0), ... K deep."""
        return [(0,) * d for d in range(1, self.k + 1)]

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(getattr(self.proposer, "hidden_layers", ()))

    def warmup(self) -> float:
        seconds = super().warmup()
        warm = getattr(self.proposer, "warmup", None)
        return seconds + (warm() if warm else 0.0)

    def _start(self, prompt, hidden):
        if self.hidden_layers:
            self.proposer.reset(prompt, hidden=hidden)
        else:
            self.proposer.reset(prompt)

    def _step(self, budget: int) -> Step:
        # Never draft more than can be emitted: at most k drafts + 1 token per step.
        k = min(self.k, budget - 1)
        draft, q = self.proposer.propose(k, self.sequence)
        m = draft.numel()
        logits, hidden = self.target.forward(torch.cat([self.pending, draft]), hidden_layers=self.hidden_layers)
        if self.temperature == 0:
            tokens = verify_greedy(draft, logits)
            verdict = torch.cat([tokens.double(), top2_margins(logits)]) if self.record_margins else tokens
        else:
            p = probabilities(logits, self.temperature, self.top_p)
            tokens = verdict = verify_sampled(draft, q, p, self.generator)
        values = verdict.tolist()  # the one host sync of the step
        n = int(values[0])
        emitted = [int(t) for t in values[1:n + 2]]
        self.target.rollback(self.target.length - (m - n))
        if self.hidden_layers:
            self.proposer.commit(n, emitted, hidden=hidden[:n + 1])
        else:
            self.proposer.commit(n, emitted)
        self.pending = tokens[n + 1:n + 2]  # stays on the device
        margins = values[m + 2:m + 2 + n + 1] if self.record_margins else None
        return Step(accepted=emitted[:-1], bonus=emitted[-1], proposed=m, margins=margins)
