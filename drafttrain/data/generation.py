"""The target answers the training prompts itself: a draft that imitates the target's own outputs
is accepted far more often than one trained on someone else's text. Answers are cached on disk,
keyed by everything that determines them, because regenerating them costs as much as training.

Writing them is the cost that grows with the data, so every rank of a launch writes a share
(`shards`: chunks dealt to the ranks, merged into the dataset one process writes), at the batch
size measured fastest (`batching`), or vLLM's offline engine writes them (`vllm_answers`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..fileio import atomic_dir
from ..prompts import PromptRecord, encode_prompt
from .config import DataConfig
from .ranks import SINGLE, Ranks
from .shards import Shards

CACHE_FORMAT = 1  # bump when the stored columns or their meaning change


def target_fingerprint(model_path_or_name: str, model, n_values: int = 1024) -> str:
    """A cheap identity of the target: path, config, and a strided sample of every weight tensor
    (values and dtype), so a fine-tuned or re-cast target never reuses another model's cached answers."""
    h = hashlib.sha256()
    path = Path(model_path_or_name)
    h.update((str(path.resolve()) if path.exists() else str(model_path_or_name)).encode())
    h.update(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // n_values)][:n_values]
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(sample.to(torch.float64).cpu().numpy().tobytes())
    return h.hexdigest()


def cache_key(fingerprint: str, prompts: Sequence[Sequence[int]], cfg: DataConfig, eos_ids: Sequence[int]) -> str:
    sampling = cfg.response_temperature > 0
    settings = {
        "format": CACHE_FORMAT,
        "target": fingerprint,
        "temperature": cfg.response_temperature,
        "top_p": cfg.response_top_p if sampling else None,
        "max_response_tokens": cfg.max_response_tokens,
        "store_topk": cfg.store_topk,
        "eos": sorted(eos_ids),
        # Answers depend on neither the batching nor the engine nor the rank (greedy ones are the
        # argmax, samples draw from a seed per prompt: data.sampling); samples depend on the seed.
        "seed": cfg.seed if sampling else None,
    }
    if sampling:
        settings["sampler"] = "per-prompt"  # samples of one stream per run (before it) were other answers
    if cfg.store_topk and cfg.prompt_loss_weight > 0:
        settings["prompt_topk"] = True  # added only when set, so caches without it keep their keys
    if cfg.generator != "drafttrain":
        settings["generator"] = cfg.generator  # another engine's numerics: its own entry
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for ids in prompts:
        h.update(json.dumps(list(ids)).encode())
        h.update(b"\n")
    return h.hexdigest()


@dataclass
class AnswerStats:
    """What writing the answers took (None fields: they were all cached)."""
    prompts: int
    chunk_size: int | None = None
    how: str = "cached"
    written: list[list[int]] | None = None  # chunks each rank wrote, in rank order
    resumed: int = 0                        # chunks an interrupted run had written
    tokens: int = 0                         # answer tokens written by this run, all ranks
    seconds: float = 0.0                    # writing them, from the plan to the last rank's last chunk
    choose_seconds: float = 0.0             # choosing the chunk size before (a measurement)

    @property
    def tokens_per_s(self) -> float:
        """Over writing AND choosing: a measured chunk size keeps its probe's first chunk, whose
        tokens are counted here while its time went into the choice."""
        total = self.seconds + self.choose_seconds
        return self.tokens / total if total > 0 else 0.0

    def line(self, ranks: int) -> str:
        if self.written is None:
            return f"target answers: {self.prompts} prompts, read from the cache"
        return (f"target answers: {self.prompts} prompts, {self.tokens} new tokens in "
                f"{self.seconds + self.choose_seconds:.1f} s "
                f"({self.tokens_per_s:.1f} tokens/s) by {ranks} process(es); chunks written per rank "
                f"{[len(w) for w in self.written]}, {self.resumed} kept from an interrupted run; chunk of "
                f"{self.chunk_size} ({self.how}; choosing it took {self.choose_seconds:.1f} s of those)")


def generate_responses(
    target_model,
    tokenizer,
    records: list[PromptRecord],
    cfg: DataConfig,
    *,
    eos_token_id: int | Sequence[int],
    cache_dir: str | Path | None = None,
    target_fingerprint: str,
    engine: str = "auto",
    ranks: Ranks = SINGLE,
    target_path: str | None = None,
):
    """Rows `prompt_ids`, `response_ids` (ending with EOS when the target stopped) and, if
    `cfg.store_topk` > 0, `topk_ids` / `topk_logprobs` of shape [len(response), k]: the target's
    top-k log-softmax (temperature 1) at each response position. With `cfg.prompt_loss_weight` > 0
    too, `prompt_topk_ids` / `prompt_topk_logprobs` [len(prompt) - 1, k] hold the target's top-k at
    prompt positions 0 .. len(prompt) - 2 (predicting prompt tokens 1 ..). Row i answers records[i].
    `engine`: auto (the static engine's batched generation on CUDA for the architectures it
    supports, else transformers' `generate`), eager (`generate`) or static. `ranks`: the processes
    writing together (collective: every one of them calls this); `target_path`: for
    `cfg.generator` vllm, the target vLLM loads. The main process prints what writing took."""
    dataset, stats = write_answers(target_model, tokenizer, records, cfg, eos_token_id=eos_token_id,
                                   cache_dir=cache_dir, target_fingerprint=target_fingerprint, engine=engine,
                                   ranks=ranks, target_path=target_path)
    if ranks.main:
        print(stats.line(ranks.size), flush=True)
    return dataset


def write_answers(target_model, tokenizer, records, cfg: DataConfig, *, eos_token_id, cache_dir=None,
                  target_fingerprint: str, engine: str = "auto", ranks: Ranks = SINGLE,
                  target_path: str | None = None):
    """`generate_responses`, returning (dataset, AnswerStats)."""
    import datasets

    cfg.validate()
    eos_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(i) for i in eos_token_id]
    prompts = [encode_prompt(r, tokenizer) for r in records]
    path = Path(cache_dir or cfg.cache_dir) / cache_key(target_fingerprint, prompts, cfg, eos_ids)
    # Only complete datasets are ever renamed into place; the main process decides for all.
    if ranks.broadcast(path.is_dir() if ranks.main else None):
        return datasets.load_from_disk(str(path)), AnswerStats(len(prompts))
    shards = Shards(path.with_name(path.name + ".parts"), prompts, ranks)
    stats = _write_shards(shards, _writer(target_model, tokenizer, prompts, cfg, eos_ids, engine, target_path),
                          ranks)
    if ranks.main:
        _save_dataset(path, prompts, shards.columns(), cfg, target_fingerprint, eos_ids)
        shards.remove()
    ranks.barrier()
    return datasets.load_from_disk(str(path)), stats


def _writer(model, tokenizer, prompts, cfg: DataConfig, eos_ids, engine: str, target_path: str | None):
    if cfg.generator == "vllm":
        from .vllm_answers import VllmWriter

        return VllmWriter(target_path, model, prompts, cfg, eos_ids)
    from ..decoding import resolve_engine
    from .batching import EngineWriter

    return EngineWriter(model, tokenizer, prompts, cfg, eos_ids, resolve_engine(engine, model))


def _write_shards(shards: Shards, writer, ranks: Ranks) -> AnswerStats:
    """Collective: this process's chunks, with a bar (main process) counting every rank's."""
    from tqdm.auto import tqdm

    plan = shards.make_plan(lambda: writer.chunk_size(ranks))
    start = time.perf_counter()
    writer.batch_size = plan.chunk_size
    mine, tokens = shards.mine(writer.main_only), 0
    try:
        with tqdm(total=len(shards.prompts), initial=shards.prompts_written() if ranks.main else 0,
                  desc="target answers", unit="prompt", disable=not ranks.main) as bar:
            for j in mine:
                chunk = writer.write(plan.chunks[j])
                shards.save(j, chunk)
                tokens += sum(len(r) for r in chunk["response_ids"])
                if ranks.main:
                    bar.update(shards.prompts_written() - bar.n)
    finally:
        writer.close()
    gathered = ranks.all_gather((mine, tokens) if ranks.writes() else ([], 0))  # in lockstep the main one wrote
    ranks.barrier()
    return AnswerStats(len(shards.prompts), plan.chunk_size, plan.how, [m for m, _ in gathered], len(plan.done),
                       sum(t for _, t in gathered), time.perf_counter() - start, plan.seconds)


def _features(names) -> dict:
    """int32 token ids and float32 log-probs; the top-k columns hold one list per position."""
    import datasets

    List = getattr(datasets, "List", None) or datasets.Sequence  # `List` since datasets 4
    features = {}
    for name in names:
        value = List(datasets.Value("float32" if name.endswith("logprobs") else "int32"))
        features[name] = List(value) if "topk" in name else value
    return features


def _save_dataset(path: Path, prompts, columns: dict[str, list], cfg: DataConfig, fingerprint: str, eos_ids) -> None:
    import datasets

    prompt_topk = bool(cfg.store_topk) and cfg.prompt_loss_weight > 0
    names = (["response_ids"] + (["topk_ids", "topk_logprobs"] if cfg.store_topk else [])
             + (["prompt_topk_ids", "prompt_topk_logprobs"] if prompt_topk else []))
    data = {"prompt_ids": prompts, **{name: columns.get(name, []) for name in names}}
    dataset = datasets.Dataset.from_dict(data, features=datasets.Features(_features(data)))
    meta = {"prompts": len(prompts), "target_fingerprint": fingerprint, "eos": eos_ids,
            **{k: getattr(cfg, k) for k in ("response_temperature", "response_top_p", "max_response_tokens",
                                            "store_topk", "seed")},
            "prompt_topk": prompt_topk}
    if cfg.generator != "drafttrain":
        meta["generator"] = cfg.generator
    try:
        with atomic_dir(path) as tmp:
            dataset.save_to_disk(str(tmp))
            (tmp / "drafttrain_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    except FileExistsError:
        pass  # another process cached the same key first; its content is equivalent
