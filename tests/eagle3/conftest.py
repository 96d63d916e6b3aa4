"""The EAGLE-3 tests' shared fixture: a tiny target and a draft trained on its answers."""

from __future__ import annotations

import pytest
import torch

from drafttrain.data.collate import TrainingCollator
from drafttrain.eagle3.loss import eagle3_loss, first_trained_index, next_tokens, teacher_logits_from_hidden
from eagle3_helpers import VOCAB, target_hidden_states, tiny_draft, tiny_target
from tiny import greedy_reference

EOS = 2


@pytest.fixture(scope="session")
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
    collate = TrainingCollator(max_seq_len=32, pad_id=EOS, align_prompts=True)
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


