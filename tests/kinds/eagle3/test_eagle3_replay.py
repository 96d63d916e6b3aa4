"""EAGLE-3 replay (`evaluation.replay`, teacher-forced acceptance) against a brute-force greedy
chain decoder built on the draft's decode-time path (prefill / rollback / step), which must also
reproduce the target's output, and against the real chain decoder, EOS endings included."""

from __future__ import annotations

import pytest
import torch

from drafttrain.kinds.eagle3.decode import draft_step, prefill
from drafttrain.kinds.features import DraftKVCache
from drafttrain.kinds.registry import Drafter
from drafttrain.evaluation.replay import teacher_forced_steps
from eagle3_helpers import VOCAB, draft_decoder, target_hidden_states, tiny_draft
from tiny import greedy_reference

EOS = 2


def greedy_chain_decode(target, draft, prompt: list[int], k_max: int, max_new: int):
    """Chain speculative decoding, greedy, the slow obvious way: the target recomputes the whole
    sequence every step (features and verification); only the draft uses its KV cache."""
    seq, out, lengths = list(prompt), [], []
    cache, committed, last = DraftKVCache(), 0, None
    while len(out) < max_new:
        c = len(seq)
        features = draft.target_features(target_hidden_states(target, torch.tensor([seq])))
        cache.rollback(committed)  # drop what was drafted
        if c - 1 > committed:      # the draft cache must hold indices 0..c-2
            last = prefill(draft, cache, features[:, committed:c - 1], torch.tensor([seq[committed + 1:c]]),
                           torch.arange(committed, c - 1)[None])
            committed = c - 1
        k = min(k_max, max_new - len(out) - 1) if c >= 2 else 0
        drafts = []
        if k > 0:
            token = int(draft.to_target_ids(last.logits[0, -1].argmax()))
            drafts.append(token)
            hidden = last.hidden[:, -1:]
            for j in range(1, k):
                step = draft_step(draft, cache, hidden, torch.tensor([[token]]), torch.tensor([[c - 2 + j]]))
                token, hidden = int(draft.to_target_ids(step.logits[0, 0].argmax())), step.hidden
                drafts.append(token)
        with torch.no_grad():
            greedy = target(torch.tensor([seq + drafts])).logits[0, c - 1:].argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == greedy[a]:
            a += 1
        emitted = drafts[:a] + [greedy[a]]
        if EOS in emitted:
            emitted = emitted[:emitted.index(EOS) + 1]
        emitted = emitted[:max_new - len(out)]
        lengths.append(min(a, len(emitted)))
        seq += emitted
        out += emitted
        if out[-1] == EOS:
            break
    return out, lengths


@pytest.mark.parametrize("k", [1, 3, 5])
def test_replay_equals_a_step_by_step_greedy_chain_decoder(trained_pair, k):
    target, draft = trained_pair
    g = torch.Generator().manual_seed(100 + k)
    seen = set()
    for trial in range(6):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        max_new = [20, 7, 1][trial % 3]
        with torch.no_grad():
            tokens, lengths = greedy_chain_decode(target, draft, prompt, k, max_new)
            assert tokens == greedy_reference(target, prompt, max_new, eos=EOS)  # lossless
            replayed, _ = teacher_forced_steps(Drafter("eagle3", draft), prompt, tokens, num_draft_tokens=k,
                                               max_new_tokens=max_new, target=target)
        assert replayed == lengths, (prompt, max_new)
        seen.update(lengths)
    assert len(seen) >= min(k, 2) + 1  # the check is not vacuous: several acceptance lengths occurred


def test_a_trained_draft_is_accepted_more_than_an_untrained_one(trained_pair):
    target, draft = trained_pair
    untrained = tiny_draft(target, draft_vocab_size=48, scale=0.5, seed=9)
    prompt = [5, 17, 33]
    tokens = greedy_reference(target, prompt, 24, eos=EOS)
    with torch.no_grad():
        trained = sum(teacher_forced_steps(Drafter("eagle3", draft), prompt, tokens, num_draft_tokens=4,
                                           max_new_tokens=24, target=target)[0])
        random = sum(teacher_forced_steps(Drafter("eagle3", untrained), prompt, tokens, num_draft_tokens=4,
                                          max_new_tokens=24, target=target)[0])
    assert trained > random


@pytest.mark.parametrize("k", [1, 4])
def test_replay_equals_the_chain_decoders_accepted_and_proposed_lengths(trained_pair, k):
    target, draft = trained_pair
    g = torch.Generator().manual_seed(7 + k)
    ended_early = 0
    for trial in range(6):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        max_new = [24, 9][trial % 2]
        real = draft_decoder(target, draft, num_draft_tokens=k, tree="chain", eos_token_ids={EOS}).generate(prompt,
                                                                                                           max_new)
        assert real.tokens == greedy_reference(target, prompt, max_new, eos=EOS)
        accepted, proposed = teacher_forced_steps(Drafter("eagle3", draft), prompt, real.tokens, num_draft_tokens=k,
                                                  max_new_tokens=max_new, target=target)
        assert (accepted, proposed) == (real.accepted_lengths, real.proposed_lengths), (prompt, max_new)
        ended_early += len(real.tokens) < max_new
    assert ended_early  # an EOS ended some outputs: the drafts past it are not counted
