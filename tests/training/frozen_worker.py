"""Run by test_frozen.py as 2 processes (gloo, CPU): a tiny target sharded with FSDP2 must give
every rank the same features, logits and greedy speculative output as the whole target."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "kinds" / "eagle3")]

from drafttrain.training.frozen import fsdp2, gathered, is_sharded_module, local_fraction  # noqa: E402
from eagle3_helpers import draft_decoder, tiny_draft, tiny_target  # noqa: E402
from tiny import greedy_reference  # noqa: E402


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    whole = tiny_target(seed=3)
    target = tiny_target(seed=3)
    draft = tiny_draft(whole, draft_vocab_size=48, scale=0.5)
    ids = torch.tensor([[5, 9, 11, 7, 30, 4]])
    with torch.no_grad():
        ref = whole(ids, output_hidden_states=True)
    fsdp2(target, torch.device("cpu"))
    with torch.no_grad():
        got = target(ids, output_hidden_states=True)
    with gathered(target, target.get_output_embeddings(), target.get_input_embeddings()):
        head = target.get_output_embeddings().weight.detach().clone()
        embedding = target.get_input_embeddings().weight.detach().clone()
    draft.attach_embeddings(torch.nn.Embedding.from_pretrained(embedding, freeze=True))
    prompt = [5, 9, 11, 7]
    outputs = {tree: draft_decoder(target, draft, num_draft_tokens=3, tree=tree, tree_nodes=8, tree_topk=2,
                                  eos_token_ids={2}).generate(prompt, 20).tokens for tree in ("chain", "dynamic")}
    report = {
        "rank": rank,
        "sharded": is_sharded_module(target),
        "local_fraction": local_fraction(target),
        "logits_equal": bool(torch.equal(got.logits, ref.logits)),
        "hidden_equal": all(torch.equal(a, b) for a, b in zip(got.hidden_states, ref.hidden_states)),
        "head_equal": bool(torch.equal(head, whole.lm_head.weight)),
        "embedding_equal": bool(torch.equal(embedding, whole.get_input_embeddings().weight)),
        "speculative": outputs,
        "reference": greedy_reference(whole, prompt, 20, eos=2),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
