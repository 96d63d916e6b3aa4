"""The target answers the training prompts itself: a draft that imitates the target's own outputs
is accepted far more often than one trained on someone else's text. Answers are cached on disk,
keyed by everything that determines them, because regenerating them costs as much as training."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

import torch

from ..fileio import atomic_dir
from ..prompts import PromptRecord, encode_prompt
from ..tokens import cut_at_eos, left_pad, pad_token_id
from .config import DataConfig

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


def cache_key(fingerprint: str, prompts: Sequence[Sequence[int]], cfg: DataConfig, eos_ids: Sequence[int],
              engine: str = "eager") -> str:
    sampling = cfg.response_temperature > 0
    settings = {
        "format": CACHE_FORMAT,
        "target": fingerprint,
        "temperature": cfg.response_temperature,
        "top_p": cfg.response_top_p if sampling else None,
        "max_response_tokens": cfg.max_response_tokens,
        "store_topk": cfg.store_topk,
        "eos": sorted(eos_ids),
        # Greedy answers do not depend on the seed or on how prompts are batched; samples do.
        "seed": cfg.seed if sampling else None,
        "batch_size": cfg.generation_batch_size if sampling else None,
    }
    if cfg.store_topk and cfg.prompt_loss_weight > 0:
        settings["prompt_topk"] = True  # added only when set, so caches without it keep their keys
    if sampling and engine == "static":
        settings["engine"] = "static"  # the same seed draws different samples on another engine
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for ids in prompts:
        h.update(json.dumps(list(ids)).encode())
        h.update(b"\n")
    return h.hexdigest()


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
):
    """Rows `prompt_ids`, `response_ids` (ending with EOS when the target stopped) and, if
    `cfg.store_topk` > 0, `topk_ids` / `topk_logprobs` of shape [len(response), k]: the target's
    top-k log-softmax (temperature 1) at each response position. With `cfg.prompt_loss_weight` > 0
    too, `prompt_topk_ids` / `prompt_topk_logprobs` [len(prompt) - 1, k] hold the target's top-k at
    prompt positions 0 .. len(prompt) - 2 (predicting prompt tokens 1 ..). Row i answers records[i].
    `engine`: auto (the static engine's batched generation on CUDA for the architectures it
    supports, else transformers' `generate`), eager (`generate`) or static."""
    import datasets

    from ..decoding import resolve_engine

    cfg.validate()
    engine = resolve_engine(engine, target_model)
    eos_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(i) for i in eos_token_id]
    prompts = [encode_prompt(r, tokenizer) for r in records]
    path = Path(cache_dir or cfg.cache_dir) / cache_key(target_fingerprint, prompts, cfg, eos_ids, engine)
    if path.is_dir():  # only complete datasets are ever renamed into place
        return datasets.load_from_disk(str(path))

    responses, topk_ids, topk_logprobs, prompt_cols = _generate_all(target_model, tokenizer, prompts, cfg, eos_ids,
                                                                    engine)
    List = getattr(datasets, "List", None) or datasets.Sequence  # `List` since datasets 4
    columns = {"prompt_ids": prompts, "response_ids": responses}
    features = {"prompt_ids": List(datasets.Value("int32")), "response_ids": List(datasets.Value("int32"))}
    if cfg.store_topk:
        columns |= {"topk_ids": topk_ids, "topk_logprobs": topk_logprobs}
        features |= {"topk_ids": List(List(datasets.Value("int32"))),
                     "topk_logprobs": List(List(datasets.Value("float32")))}
    if prompt_cols is not None:
        columns |= {"prompt_topk_ids": prompt_cols[0], "prompt_topk_logprobs": prompt_cols[1]}
        features |= {"prompt_topk_ids": List(List(datasets.Value("int32"))),
                     "prompt_topk_logprobs": List(List(datasets.Value("float32")))}
    dataset = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
    try:
        with atomic_dir(path) as tmp:
            dataset.save_to_disk(str(tmp))
            meta = {"prompts": len(prompts), "target_fingerprint": target_fingerprint, "eos": eos_ids,
                    **{k: getattr(cfg, k) for k in ("response_temperature", "response_top_p",
                                                    "max_response_tokens", "store_topk", "seed")},
                    "prompt_topk": prompt_cols is not None}
            (tmp / "drafttrain_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    except FileExistsError:
        pass  # another process cached the same key first; its content is equivalent
    return datasets.load_from_disk(str(path))


@torch.inference_mode()
def _generate_all(model, tokenizer, prompts, cfg: DataConfig, eos_ids: list[int], engine: str = "eager"):
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    pad_id = pad_token_id(tokenizer, model)
    sampling = cfg.response_temperature > 0
    sample_kwargs = (
        # top_k=0 switches off transformers' default top-k of 50: we want the target's own distribution.
        dict(do_sample=True, temperature=cfg.response_temperature, top_p=cfg.response_top_p, top_k=0)
        if sampling else dict(do_sample=False)
    )
    k = cfg.store_topk
    n = len(prompts)
    responses: list = [None] * n
    topk_ids: list = [None] * n
    topk_logprobs: list = [None] * n
    with_prompt_topk = bool(k) and cfg.prompt_loss_weight > 0
    prompt_ids_k: list = [None] * n
    prompt_logprobs_k: list = [None] * n
    # Longest first: similar lengths share a batch (little padding) and an out-of-memory shows up at once.
    order = sorted(range(n), key=lambda i: -len(prompts[i]))
    bs = cfg.generation_batch_size
    static = None
    if engine == "static" and prompts:
        from ..decoding.batch import BatchGenerator

        longest = max(map(len, prompts))
        static = BatchGenerator(model, batch_size=min(bs, n), max_length=longest + cfg.max_response_tokens)
    rng_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(cfg.seed)
        with tqdm(total=n, desc="target responses", unit="prompt") as bar:  # closed however the loop ends
            for start in range(0, n, bs):
                idx = order[start:start + bs]
                input_ids, attention_mask = left_pad([prompts[i] for i in idx], pad_id, device)
                if with_prompt_topk:
                    for row, (ids, lps) in enumerate(prompt_topk(model, input_ids, attention_mask, k)):
                        prompt_ids_k[idx[row]], prompt_logprobs_k[idx[row]] = ids, lps
                if static is not None:
                    new_tokens, values, indices = static.generate(
                        input_ids, attention_mask, max_new_tokens=cfg.max_response_tokens, eos_token_ids=eos_ids,
                        temperature=cfg.response_temperature, top_p=cfg.response_top_p, topk=k)
                else:
                    out = model.generate(
                        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=cfg.max_response_tokens,
                        eos_token_id=eos_ids, pad_token_id=pad_id, return_dict_in_generate=True,
                        output_logits=k > 0, **sample_kwargs,
                    )
                    new_tokens = out.sequences[:, input_ids.shape[1]:].tolist()
                if k and static is None:
                    logits = torch.stack(out.logits, dim=1)  # [B, steps, V], unprocessed
                    logprobs = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
                    values, indices = logprobs.topk(k, dim=-1)
                    values, indices = values.float().cpu(), indices.cpu()
                for row, i in enumerate(idx):
                    responses[i] = cut_at_eos(new_tokens[row], eos_ids)
                    if k:
                        m = len(responses[i])
                        topk_ids[i] = indices[row, :m].tolist()
                        topk_logprobs[i] = values[row, :m].tolist()
                bar.update(len(idx))
    return responses, topk_ids, topk_logprobs, ((prompt_ids_k, prompt_logprobs_k) if with_prompt_topk else None)


def prompt_topk(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, k: int) -> list[tuple[list, list]]:
    """Per left-padded row: the target's top-k (ids, log-probs) at each prompt position but the last
    (that one predicts the first response token, stored with the response)."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    out = []
    for row in range(input_ids.shape[0]):  # one row at a time: a float32 [T, V] copy is small, [B, T, V] is not
        n = int(attention_mask[row].sum())
        lp = logits[row, input_ids.shape[1] - n:-1].float().log_softmax(-1)
        values, indices = lp.topk(min(k, lp.shape[-1]), dim=-1)
        out.append((indices.cpu().tolist(), values.cpu().tolist()))
    return out
