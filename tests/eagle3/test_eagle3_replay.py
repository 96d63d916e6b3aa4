"""Teacher-forced acceptance against a brute-force greedy chain decoder built on the draft's
decode-time path (prefill / rollback / step), which must also reproduce the target's output."""

from __future__ import annotations

import pytest
import torch

from drafttrain.data.collate import DistillCollator
from drafttrain.eagle3.loss import eagle3_loss, first_trained_index, next_tokens, teacher_logits_from_hidden
from drafttrain.eagle3.model import Eagle3KVCache
from drafttrain.eagle3.replay import teacher_forced_accepted_lengths
from eagle3_helpers import VOCAB, target_hidden_states, tiny_draft, tiny_target
from tiny import greedy_reference

EOS = 2


def greedy_chain_decode(target, draft, prompt: list[int], k_max: int, max_new: int):
    """Chain speculative decoding, greedy, the slow obvious way: the target recomputes the whole
    sequence every step (features and verification); only the draft uses its KV cache."""
    seq, out, lengths = list(prompt), [], []
    cache, committed, last = Eagle3KVCache(), 0, None
    while len(out) < max_new:
        c = len(seq)
        features = draft.target_features(target_hidden_states(target, torch.tensor([seq])))
        cache.rollback(committed)  # drop what was drafted
        if c - 1 > committed:      # the draft cache must hold indices 0..c-2
            last = draft.prefill(cache, features[:, committed:c - 1], torch.tensor([seq[committed + 1:c]]),
                                 torch.arange(committed, c - 1)[None])
            committed = c - 1
        k = min(k_max, max_new - len(out) - 1) if c >= 2 else 0
        drafts = []
        if k > 0:
            token = int(draft.to_target_ids(last.logits[0, -1].argmax()))
            drafts.append(token)
            hidden = last.hidden[:, -1:]
            for j in range(1, k):
                step = draft.step(cache, hidden, torch.tensor([[token]]), torch.tensor([[c - 2 + j]]))
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


@pytest.fixture(scope="module")
def trained_pair():
    """A draft trained for a few seconds on the target's greedy answers: it is right often
    enough that acceptance lengths of every size occur."""
    target = tiny_target(seed=3)
    draft = tiny_draft(target, draft_vocab_size=48, scale=0.5).train()
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(24):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        rows.append({"prompt_ids": prompt, "response_ids": greedy_reference(target, prompt, 16, eos=EOS)})
    collate = DistillCollator(max_seq_len=32, pad_id=EOS, align_prompts=True)
    optim = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    steps = 3
    for it in range(80):
        batch = collate(rows[(it * 8) % 24:(it * 8) % 24 + 8])
        hs = target_hidden_states(target, batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        start = first_trained_index(batch["loss_mask"], steps)
        logits = draft(draft.target_features(hs), batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], num_steps=steps, logits_from=start)
        teacher = teacher_logits_from_hidden(hs[-1][:, start:], target.lm_head.weight, draft.draft_target_ids)
        out = eagle3_loss(logits, teacher, batch["loss_mask"][:, start:], batch["attention_mask"][:, start:],
                          next_tokens(batch["input_ids"], start), draft.d2t, draft.t2d)
        optim.zero_grad()
        out.loss.backward()
        optim.step()
    return target, draft.eval()


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
            replayed = teacher_forced_accepted_lengths(draft, target, prompt, tokens, num_draft_tokens=k,
                                                       max_new_tokens=max_new)
        assert replayed == lengths, (prompt, max_new)
        seen.update(lengths)
    assert len(seen) >= min(k, 2) + 1  # the check is not vacuous: several acceptance lengths occurred


def test_a_trained_draft_is_accepted_more_than_an_untrained_one(trained_pair):
    target, draft = trained_pair
    untrained = tiny_draft(target, draft_vocab_size=48, scale=0.5, seed=9)
    prompt = [5, 17, 33]
    tokens = greedy_reference(target, prompt, 24, eos=EOS)
    with torch.no_grad():
        trained = sum(teacher_forced_accepted_lengths(draft, target, prompt, tokens, num_draft_tokens=4,
                                                      max_new_tokens=24))
        random = sum(teacher_forced_accepted_lengths(untrained, target, prompt, tokens, num_draft_tokens=4,
                                                     max_new_tokens=24))
    assert trained > random
