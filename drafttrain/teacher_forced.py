"""Greedy acceptance of a draft model from ONE forward pass over the target's own output.

Under greedy verification a draft token is accepted iff it equals the target's greedy token, and
after an acceptance the draft continues from exactly the target's prefix. So the draft's argmax
at every position of (prompt + the target's greedy output) decides every step of chain
speculative decoding: the accepted lengths follow by replaying the decoder's step rule
(`SpeculativeDecoder.generate`). Seconds instead of minutes per draft, which makes comparing
many candidate drafts (layer choices, checkpoints) cheap. It measures acceptance only: timings
still come from real decoding (`drafttrain eval`).
"""

from __future__ import annotations

import torch


def chain_accepted_lengths(matches: list[bool], num_draft_tokens: int, max_new_tokens: int) -> list[int]:
    """Accepted draft tokens per verification step, given whether the draft's greedy token matches
    the target's at each of the target's output positions (len(matches) output tokens, the last
    one EOS when the target stopped early). Mirrors the decoder: K' = min(K, tokens left - 1)
    drafts per step, the accepted prefix plus one target token emitted, nothing past the end."""
    out, t, n = [], 0, len(matches)
    while t < n:
        k = min(num_draft_tokens, max_new_tokens - t - 1)
        a = 0
        while a < k and t + a < n and matches[t + a]:
            a += 1
        emitted = min(a + 1, n - t)
        out.append(min(a, emitted))
        t += emitted
    return out


@torch.no_grad()
def teacher_forced_accepted_lengths(draft, prompt: list[int], target_tokens: list[int], *,
                                    num_draft_tokens: int, max_new_tokens: int) -> list[int]:
    """Accepted lengths of greedy chain decoding with `draft`, where `target_tokens` is the
    target's greedy output for `prompt` (e.g. `baseline_token_ids` of a report's outputs.jsonl)."""
    if not target_tokens:
        return []
    device = next(draft.parameters()).device
    ids = torch.tensor([list(prompt) + list(target_tokens)], dtype=torch.long, device=device)
    keep = len(target_tokens) + 1  # logits of the last prompt position onwards
    logits = draft(input_ids=ids, logits_to_keep=keep).logits[0, :len(target_tokens)]
    predicted = logits.argmax(-1).tolist()
    matches = [p == t for p, t in zip(predicted, target_tokens)]
    return chain_accepted_lengths(matches, num_draft_tokens, max_new_tokens)


def tau(num_tokens: int, accepted_lengths: list[int]) -> float:
    """Mean accepted length as reports define it: new tokens per verification step (a step that
    ends at EOS can emit fewer than accepted + 1 tokens, so this is not the mean of accepted + 1)."""
    return num_tokens / max(len(accepted_lengths), 1)
