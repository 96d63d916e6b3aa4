"""A parallel draft LM (PARD): K drafts from ONE forward over [pending tokens, K-1 mask tokens].

The draft was trained (`drafttrain.kinds.parallel_lm.model`) so that at mask j after the last real token its
logits propose the token j places further on. Its cache holds every token of the sequence
except `pending` (the tokens emitted since its last forward: the whole prompt at the start,
then each step's accepted drafts and bonus token). A step feeds pending and k-1 masks, reads
the k drafts off the last k positions, and rolls the masks' entries back (on the static engine
a length moves): the drafts themselves never enter the draft's cache; the target decides which
of them become real tokens, and those come back as the next step's pending.

Sampling draws draft j from its own q_j: q_j does not depend on the earlier drafts of the step,
which the chain rejection rule allows, so decoding stays exactly the target's distribution.
"""

from __future__ import annotations

import torch

from ...decoding.chain import Proposer
from ...decoding.engines import as_cached_lm, device_tensor
from ...decoding.verify import Greedy, Sampled
from ..draft_lm.decode import target_vocab_logits


class ParallelDraftProposer(Proposer):
    """`model`: a cached LM (any engine) or a plain HF model; `mask_id`: its `pard_token`;
    `parallel_tokens`: the K it was trained for (the static engine's step sizes); `rule`: the
    decoder's acceptance rule (None: greedy), which picks the drafts (`rule.pick`)."""

    name = "parallel_draft"

    def __init__(self, model, target_vocab_size: int, mask_id: int, rule: Greedy | Sampled | None = None,
                 parallel_tokens: int | None = None):
        self.lm = as_cached_lm(model)
        self.vocab, self.mask_id = target_vocab_size, mask_id
        self.rule = rule or Greedy()
        self.parallel_tokens = parallel_tokens
        self.device = self.lm.device
        self.pending: list[int] = []
        self.forwards = 0

    def reset(self, prompt, hidden=None):
        self.lm.reset()
        self.pending = list(prompt)

    def warmup_sizes(self) -> list[int]:
        """A step feeds 1 .. K pending tokens and K-1 masks: sizes K .. 2K-1."""
        k = self.parallel_tokens or 4
        return list(range(k, 2 * k))

    def propose(self, k, sequence):
        if k == 0:
            return torch.empty(0, dtype=torch.long, device=self.device), None
        tokens = device_tensor(self.pending + [self.mask_id] * (k - 1), self.device)
        logits = target_vocab_logits(self.lm.forward(tokens)[0][-k:], self.vocab)
        self.forwards += 1
        self.lm.rollback(self.lm.length - (k - 1))  # the masks' entries: only the real tokens stay
        self.pending = []
        tokens, q = self.rule.pick(logits)
        return tokens.view(k), q

    def commit(self, n_accepted, emitted, hidden=None):
        self.pending = self.pending + list(emitted)  # accepted drafts and the bonus: real tokens now
