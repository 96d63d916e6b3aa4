"""Greedy chain acceptance of an EAGLE-3 draft from ONE target forward and ONE unroll.

EAGLE-3's analogue of `drafttrain/teacher_forced.py`. Under greedy verification a draft token is
accepted iff it equals the target's greedy token, and after an acceptance the draft continues
from exactly the target's prefix. So, given the target's own greedy continuation of a prompt,
every draft a chain decoder would make is a cell of the training-time-test unroll over
(prompt + continuation):

A verification step that starts with t output tokens emitted (sequence length c = P + t, the
draft cache holding indices 0..c-2) drafts token j (0-based) with step j of the unroll at index
p = c - 2: step 0 reads the target's features there and the pending token s[c-1], step j >= 1
its own previous hidden state and s[c-1+j], which IS the draft's previous token whenever that
was accepted. The step accepts the leading drafts equal to s[c+j]. Replaying the decoder's
step rule (K' = min(K, tokens left - 1) drafts, accepted prefix + one target token emitted)
then gives exactly its accepted lengths. A single-token prompt has no index to draft from at
the first step: that step proposes nothing (accepted length 0), as a decoder must.
"""

from __future__ import annotations

import torch

from .model import Eagle3Draft


def chain_accepted_lengths_from_grid(guesses: list[list[int]], sequence: list[int], prompt_len: int,
                                     num_draft_tokens: int, max_new_tokens: int) -> list[int]:
    """guesses[p][j]: the draft's greedy target id at index p, unroll step j. `sequence` is the
    prompt followed by the target's continuation (its last token EOS if the target stopped)."""
    n = len(sequence) - prompt_len
    out, t = [], 0
    while t < n:
        p = prompt_len + t - 2
        k = min(num_draft_tokens, max_new_tokens - t - 1) if p >= 0 else 0
        a = 0
        while a < k and t + a < n and guesses[p][a] == sequence[prompt_len + t + a]:
            a += 1
        emitted = min(a + 1, n - t)
        out.append(min(a, emitted))
        t += emitted
    return out


@torch.no_grad()
def teacher_forced_accepted_lengths(draft: Eagle3Draft, target, prompt: list[int], target_tokens: list[int], *,
                                    num_draft_tokens: int, max_new_tokens: int) -> list[int]:
    """Accepted lengths of greedy chain decoding with `draft` (target's embedding attached),
    where `target_tokens` is the target's greedy output for `prompt` (e.g. `baseline_token_ids`
    of a report's outputs.jsonl). Costs one target forward and a K-step unroll."""
    if not target_tokens:
        return []
    sequence = list(prompt) + list(target_tokens)
    device = next(draft.parameters()).device
    ids = torch.tensor([sequence], dtype=torch.long, device=device)
    hidden_states = target(input_ids=ids, output_hidden_states=True).hidden_states
    first = max(len(prompt) - 2, 0)  # the first index a verification step drafts from
    logits = draft(draft.target_features(hidden_states), ids, num_steps=max(num_draft_tokens, 1), logits_from=first)
    guesses = draft.to_target_ids(logits[:, 0].argmax(-1)).T.tolist()  # [index - first][step]
    grid = [[] for _ in range(first)] + guesses
    return chain_accepted_lengths_from_grid(grid, sequence, len(prompt), num_draft_tokens, max_new_tokens)
