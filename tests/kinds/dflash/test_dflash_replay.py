"""DFlash replay (`evaluation.replay`, teacher-forced acceptance from one target forward and one draft
forward of every step's block) against the real chain decoder's accepted lengths, EOS endings and
token budgets included."""

from __future__ import annotations

import pytest
import torch
from dflash_helpers import EOS, VOCAB

from drafttrain.decoding import DecodeSettings
from drafttrain.evaluation.replay import teacher_forced_steps
from drafttrain.kinds.base import Drafter
from drafttrain.kinds.factory import build_decoder


@pytest.mark.parametrize("k", [1, 3, 4])
def test_replay_equals_the_decoders_accepted_lengths(trained_pair, k):
    target, draft = trained_pair
    drafter = Drafter("dflash", draft)
    decoder = build_decoder(target, drafter, DecodeSettings(num_draft_tokens=k, eos_token_ids=frozenset({EOS})))
    g = torch.Generator().manual_seed(100 + k)
    seen = set()
    for trial in range(6):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        max_new = [20, 7, 1][trial % 3]
        gen = decoder.generate(prompt, max_new)
        with torch.no_grad():
            replayed, _ = teacher_forced_steps(drafter, prompt, gen.tokens, num_draft_tokens=k, max_new_tokens=max_new,
                                               target=target)
        assert replayed == gen.accepted_lengths, (prompt, max_new)
        seen.update(gen.accepted_lengths)
    assert len(seen) >= min(k, 2) + 1  # not vacuous: several acceptance lengths occurred
