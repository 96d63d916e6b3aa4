"""Run by test_answer_shards.py as N processes (torch.distributed.run, gloo, CPU): every rank writes
its share of a tiny target's answers (and of self-instruct prompts) into one cache, and reports
what it wrote in OUT/rank{r}.json. `build` gives the same settings to the one-process reference."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
# Before the group exists, or the group outlives destroy_process_group: see
# drafttrain.training.distributed.close_process_group.
import torch.distributed.nn.functional  # noqa: F401

from drafttrain.data.config import DataConfig
from drafttrain.data.ranks import Ranks
from drafttrain.prompts import PromptRecord

SLOW = dict(n=24, batch=1, max_new=64, eos_boost=0.0)   # long answers, one per chunk: time to kill mid-way
QUICK = dict(n=30, batch=3, max_new=12, eos_boost=3.0)


def fixtures():
    """tests/data/conftest.py by its path (`import conftest` finds whichever test directory's came first)."""
    spec = importlib.util.spec_from_file_location("data_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(cache_dir: str, temperature: float, slow: bool = False):
    """(target, tokenizer, records, cfg): prompts of many lengths, top-k stored, a fixed batch."""
    size = SLOW if slow else QUICK
    records = [PromptRecord(id=i, category="d", source=f"t:{i}",
                            text=" ".join(f"w{(7 * i + j) % 80}" for j in range(1 + (5 * i) % 11)))
               for i in range(size["n"])]
    records.append(PromptRecord(id="again", category="d", source="t:again", text=records[3].text))  # a copy
    cfg = DataConfig(max_response_tokens=size["max_new"], generation_batch_size=size["batch"], store_topk=3,
                     response_temperature=temperature, seed=5, cache_dir=cache_dir)
    return fixtures().build_model(eos_boost=size["eos_boost"]), fixtures().build_tokenizer(), records, cfg


def gloo_ranks() -> Ranks:
    import torch.distributed as dist

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(obj):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    return Ranks(rank=dist.get_rank(), size=dist.get_world_size(), broadcast=broadcast, all_gather=all_gather,
                 barrier=dist.barrier)


def main(out: str, cache_dir: str, temperature: float, slow: bool) -> None:
    import torch.distributed as dist

    from drafttrain.data.generation import write_answers
    from drafttrain.data.sources import self_instruct_prompts

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ranks = gloo_ranks()
    Path(out, f"pid{ranks.rank}").write_text(str(os.getpid()))  # workers run in sessions of their own
    model, tokenizer, records, cfg = build(cache_dir, temperature, slow)
    _, stats = write_answers(model, tokenizer, records, cfg, eos_token_id=3, target_fingerprint="fp", ranks=ranks)
    report = {"written": stats.written, "resumed": stats.resumed, "tokens": stats.tokens}
    if not slow:
        report["self_instruct"] = self_instruct_prompts(fixtures().build_model(eos_boost=25.0), tokenizer, 7, max_prompt_tokens=24,
                                                        seed=1, batch_size=2, min_chars=2, ranks=ranks)
    Path(out, f"rank{ranks.rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), os.environ.get("ANSWERS_SLOW") == "1")
