"""Chain speculative decoding: a proposer drafts up to K tokens, the target verifies them in one pass.

Each step sends [pending, d_1..d_k] through the target; the logits at those k+1 positions score
every draft and give the bonus token. Greedy: the longest draft prefix equal to the target's
argmax. Sampling: the rejection rule of `verify.verify_sampled` (lossless for any proposer). The
decoder takes its rule as an object (`verify.Greedy`, `verify.Sampled`): verify.py holds every rule.
The cache then rolls back to pending plus the accepted drafts (on the static engine: moving a
length). A proposer that reads the target's hidden states (`Proposer.hidden_layers`) gets those
of every newly kept position, from the same forward.
"""

from __future__ import annotations

import torch

from .loop import Decoder, Step
from .verify import GreedyVerdict


class Proposer:
    """Where a chain decoder's drafts come from.

    A proposer sees the whole token sequence so far and proposes up to k next tokens, together
    with the distribution q each was drawn from (None: a deterministic proposal, i.e. one-hot q).
    After the target has verified them, `commit` tells it which tokens were emitted so it can keep
    its own state (a draft model's KV cache) in step.

    A proposer that reads the target's hidden states (EAGLE-style) names the layers it wants in
    `hidden_layers` (transformers' `output_hidden_states` indexing: 0 = embeddings, L = the final
    post-norm state). The decoder then asks the target for them in the forward passes it runs
    anyway and hands over those of every position that enters the target's cache: the prompt's
    (all but its last token) to `reset(prompt, hidden=...)`, and after each step those of pending
    plus the accepted drafts to `commit(n_accepted, emitted, hidden=...)`, [n_accepted + 1, D].
    """

    name = "none"
    hidden_layers: tuple[int, ...] = ()
    forwards = 0  # the drafter's model forwards so far (SPEC §7 draft_forwards); none for lookups

    def reset(self, prompt: list[int], hidden: torch.Tensor | None = None) -> None:
        pass

    def propose(self, k: int, sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def commit(self, n_accepted: int, emitted: list[int], hidden: torch.Tensor | None = None) -> None:
        pass

    def keep(self, n_accepted: int, emitted: list[int], verdict: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """After a verification: `commit`, with the hidden states of the kept positions if the
        proposer reads any. `verdict` (on the device: [n, emitted..., padding], see
        `verify.verify_greedy`) and `hidden` (every verified row, padding included) are there
        for a proposer that runs its commit and its next drafts in one graph driven by them."""
        if self.hidden_layers:
            self.commit(n_accepted, emitted, hidden=hidden[:n_accepted + 1])
        else:
            self.commit(n_accepted, emitted)

    def warmup(self) -> float:
        """Compile/capture whatever the proposer runs; returns the seconds spent. Here: the steps
        of `warmup_sizes` tokens on the proposer's own cached LM (`lm`), where it has one."""
        lm = getattr(self, "lm", None)
        return lm.warmup(self.warmup_sizes()) if lm is not None else 0.0

    def warmup_sizes(self) -> list[int]:
        """The step sizes the proposer's own cached LM runs (none without one)."""
        return []


class NoProposer(Proposer):
    """Plain decoding on the same engine: the baseline."""

    name = "none"

    def __init__(self, device: torch.device):
        self.empty = torch.empty(0, dtype=torch.long, device=device)

    def propose(self, k, sequence):
        return self.empty, None


class ChainDecoder(Decoder):
    name = "chain"

    def __init__(self, target, proposer: Proposer, *, num_draft_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, eos_token_ids: set[int] = frozenset(),
                 generator: torch.Generator | None = None, record_margins: bool = False, rule=None):
        super().__init__(target, temperature=temperature, top_p=top_p, eos_token_ids=eos_token_ids,
                         generator=generator, record_margins=record_margins, rule=rule)
        self.proposer = proposer
        self.k = 0 if isinstance(proposer, NoProposer) else num_draft_tokens
        # greedy: the verdict runs inside the target's verification graph; sampling draws from a
        # generator, so its rule runs after the forward
        self.verdict = GreedyVerdict(margins=record_margins) if self.rule.greedy else None

    @property
    def num_draft_tokens(self) -> int:
        return self.k

    @property
    def tree(self) -> list[tuple[int, ...]]:
        """Chain verification as a Medusa tree: (0,), (0, 0), ... K deep."""
        return [(0,) * d for d in range(1, self.k + 1)]

    def drafting(self) -> Proposer:
        return self.proposer

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
        tokens = torch.cat([self.pending, draft])
        if self.verdict is not None:
            verdict, hidden = self.target.verify(tokens, self.verdict, hidden_layers=self.hidden_layers)
        else:
            logits, hidden = self.target.forward(tokens, hidden_layers=self.hidden_layers)
            verdict = self.rule.chain(draft, q, logits)
        values = verdict.tolist()  # the one host sync of the step
        n = int(values[0])
        emitted = [int(t) for t in values[1:n + 2]]
        width = (len(values) - 1) // 2  # the verified rows (padding included) when margins follow
        self.target.rollback(self.target.length - (m - n))
        self.proposer.keep(n, emitted, verdict, hidden)
        self.pending = verdict[n + 1:n + 2].long() if self.record_margins else verdict[n + 1:n + 2]  # on the device
        margins = values[1 + width:1 + width + n + 1] if self.record_margins else None
        return Step(accepted=emitted[:-1], bonus=emitted[-1], proposed=m, margins=margins)
