"""The target's answers written by vLLM's offline engine (`data.generator: vllm`): its own
continuous batching and kernels, the same sampling settings, and the top-k log-probs where asked.

What vLLM gives and what it cannot:
- Log-probs are vLLM's raw ones (its default `logprobs_mode`: the log-softmax of the model's
  logits before temperature and top-p), so `topk_*` mean what drafttrain's mean. They are computed
  in vLLM's own kernels and dtype: equal to drafttrain's up to float rounding, not bit for bit.
- Prompt top-k (`prompt_loss_weight` > 0) comes from vLLM's `prompt_logprobs`; prefix caching is
  then off, since vLLM computes no prompt log-probs for cached tokens.
- Samples come from vLLM's generator with a seed per prompt (`data.sampling.prompt_seeds`): a
  prompt's answer does not depend on its batch, but it is not the answer drafttrain samples with
  the same seed, so a vLLM cache entry is its own (`generation.cache_key`).
- vLLM runs on the main process only, on its own copy of the target; in a multi-process launch
  the other ranks wait (vLLM inside `accelerate launch` would start its own distributed group).
- A float64 target cannot run in vLLM: one `error:` line.
"""

from __future__ import annotations

import torch

from ..errors import UserError
from ..tokens import cut_at_eos
from .config import DataConfig
from .sampling import prompt_seeds

CHUNK_PROMPTS = 1024        # prompts per `generate` call (and per chunk file): vLLM batches within it
KV_CACHE_BYTES = {"cpu": 1 << 30, "cuda": 8 << 30}  # not a share of memory: the recipe holds the rest


class VllmWriter:
    """`write(indices)` -> one chunk (see `shards`) of vLLM's answers. The engine starts on the first
    chunk (on the main process alone) and stops at `close`."""

    main_only = True

    def __init__(self, target_path: str | None, model, prompts: list[list[int]], cfg: DataConfig, eos_ids: list[int]):
        if target_path is None:  # (whether vLLM is installed, DataConfig.validate said)
            raise ValueError("data.generator=vllm needs the target's path")
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        if self.dtype == "float64":
            raise UserError("vLLM cannot run a float64 target; set target_dtype=float32 (or data.generator=drafttrain)")
        self.device = next(model.parameters()).device.type
        self.target, self.prompts, self.cfg, self.eos_ids = target_path, prompts, cfg, eos_ids
        self.seeds = [s % (1 << 31) for s in prompt_seeds(cfg.seed, prompts)]  # vLLM takes a 32-bit seed
        self.prompt_topk = bool(cfg.store_topk) and cfg.prompt_loss_weight > 0
        self.batch_size = CHUNK_PROMPTS
        self.llm = None

    def chunk_size(self, ranks) -> tuple[int, str]:
        return CHUNK_PROMPTS, "vLLM schedules its own batches within a chunk"

    def _engine(self):
        from vllm import LLM

        if self.llm is None:
            k = self.cfg.store_topk
            try:
                self.llm = LLM(model=self.target, dtype=self.dtype, seed=self.cfg.seed, skip_tokenizer_init=True,
                               max_model_len=max(map(len, self.prompts)) + self.cfg.max_response_tokens,
                               generation_config="vllm",  # vLLM's sampling defaults, not the model card's
                               max_logprobs=max(k, 20), enable_prefix_caching=not self.prompt_topk,
                               kv_cache_memory_bytes=KV_CACHE_BYTES.get(self.device, KV_CACHE_BYTES["cpu"]))
            except Exception as e:  # vLLM refuses a model or a setting by raising from deep inside its engine
                lines = str(e).strip().splitlines()
                raise UserError(f"vLLM could not load the target ({type(e).__name__}: "
                                f"{lines[-1][:300] if lines else ''}); its log above says why, or set "
                                "data.generator=drafttrain") from e
        return self.llm

    def write(self, indices: list[int]) -> dict:
        from vllm import SamplingParams

        cfg, k = self.cfg, self.cfg.store_topk
        params = [SamplingParams(max_tokens=cfg.max_response_tokens, temperature=cfg.response_temperature,
                                 top_p=cfg.response_top_p, seed=self.seeds[i], stop_token_ids=list(self.eos_ids),
                                 detokenize=False, logprobs=k or None,
                                 prompt_logprobs=k if self.prompt_topk else None) for i in indices]
        outputs = self._engine().generate([{"prompt_token_ids": self.prompts[i]} for i in indices], params,
                                          use_tqdm=False)
        chunk: dict = {"index": torch.tensor(indices, dtype=torch.long), "response_ids": []}
        for out in outputs:
            completion = out.outputs[0]
            response = self._response(completion)
            chunk["response_ids"].append(torch.tensor(response, dtype=torch.long))
            if k:
                _append_topk(chunk, "topk", completion.logprobs[:len(response)], k)
            if self.prompt_topk:
                _append_topk(chunk, "prompt_topk", (out.prompt_logprobs or [None])[1:], k)
        return chunk

    def _response(self, completion) -> list[int]:
        """Its tokens up to the first EOS, the EOS kept (vLLM reports a stop token as the stop reason)."""
        tokens = cut_at_eos(list(completion.token_ids), self.eos_ids)
        if completion.finish_reason == "stop" and (not tokens or tokens[-1] not in self.eos_ids) \
                and completion.stop_reason in self.eos_ids:
            tokens.append(completion.stop_reason)
        return tokens

    def close(self) -> None:
        if self.llm is not None:
            from ..evaluation.vllm_backend import shutdown

            shutdown(self.llm)
            self.llm = None


def _append_topk(chunk: dict, prefix: str, positions, k: int) -> None:
    """Each position's top-k (ids, log-probs) by vLLM's rank (it adds the sampled or prompt token
    with its own rank, dropped here unless it is in the top k)."""
    ids, values = [], []
    for entries in positions:
        best = sorted(((lp.rank, tid, lp.logprob) for tid, lp in entries.items() if lp.rank <= k),
                      key=lambda e: (e[0], -e[2]))[:k]
        if len(best) < k:
            raise UserError(f"vLLM returned {len(best)} of the {k} log-probs asked for; lower data.store_topk")
        ids.append([tid for _, tid, _ in best])
        values.append([value for _, _, value in best])
    chunk.setdefault(f"{prefix}_ids", []).append(torch.tensor(ids, dtype=torch.long).reshape(len(ids), k))
    chunk.setdefault(f"{prefix}_logprobs", []).append(torch.tensor(values, dtype=torch.float32).reshape(len(ids), k))


__all__ = ["CHUNK_PROMPTS", "VllmWriter"]
