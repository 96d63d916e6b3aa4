"""`data.sampling`: the top-k a step's answers store, recorded step by step (`TopkRecorder`)
rather than from every step's whole vocabulary row."""

import pytest
import torch
from tiny import tiny_lm

from drafttrain.data.sampling import TopkRecorder, sampling_kwargs


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_recorded_topk_equals_the_topk_of_generates_raw_logits(temperature):
    model = tiny_lm(3, dtype=torch.float64)
    ids = torch.tensor([[0, 0, 5, 9, 11], [4, 8, 15, 16, 23]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    seeds, k = [11, 12], 5
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=7, pad_token_id=0, return_dict_in_generate=True)
    recorder = TopkRecorder(k)
    out = model.generate(**common, **sampling_kwargs(seeds, ids.shape[1], temperature, 0.95, recorder))
    reference = model.generate(**common, output_logits=True, **sampling_kwargs(seeds, ids.shape[1], temperature, 0.95))
    assert torch.equal(out.sequences, reference.sequences)  # recording changes no token
    logprobs = torch.stack(reference.logits, dim=1).log_softmax(-1)
    values, indices = logprobs.topk(k, dim=-1)
    got_values, got_ids = recorder.stacked()
    assert got_values.shape == (2, 7, k) and got_values.dtype == torch.float32
    assert torch.equal(got_ids, indices)
    torch.testing.assert_close(got_values, values.float())
