"""Loading what an evaluation decodes with, once: the target, each drafter, and their engines.

Every model is checked as it loads (a damaged file, non-finite weights, a drafter made for another
target are one `error:` line). The target and each draft model are then bound to ONE cached LM
each (`--engine`), sized for the longest prompt and shared by every decoder of the run, so steps
are compiled and captured once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..decoding import CachedLM, cached_lm
from ..kinds.base import Drafter
from ..kinds.registry import BY_NAME, target_alone
from ..kinds.factory import max_step_tokens, tree_choice
from ..errors import UserError
from ..models import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype
from ..prompts import EncodedPrompt
from ..tokens import eos_token_ids
from ..trees import widest_choice
from .config import PLAN_PROBE_TOKENS, EvalConfig


@dataclass
class LoadedModels:
    """Everything one evaluation needs, loaded and checked once: the target and ONE drafter, as
    loaded (its kind resolved: a draft LM with a pard_token is a parallel one), then bound to its
    engine in place by `bind_engine`."""

    target: torch.nn.Module
    tokenizer: object
    device: torch.device
    eos: set[int]
    drafter: Drafter = field(default_factory=target_alone)
    target_lm: CachedLM | None = None  # the engine-bound target (`bind_engine`), shared by every decoder
    served: object | None = None  # --backend vllm: the run's vLLM engines (`vllm_backend.ServedEngines`)

    @property
    def dtype_name(self) -> str:
        return str(self.target.dtype).removeprefix("torch.")


def load_models(cfg: EvalConfig) -> LoadedModels:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    tokenizer = load_tokenizer(cfg.target, "target")
    target = load_causal_lm(cfg.target, dtype, device, "target")
    models = LoadedModels(target=target, tokenizer=tokenizer, device=device, eos=set(eos_token_ids(tokenizer, target)))
    return attach_drafter(models, cfg)


def attach_drafter(models: LoadedModels, cfg: EvalConfig) -> LoadedModels:
    """`models` (a copy) with cfg's drafter loaded from its export by its kind, after checking it
    fits the target; a drafter without weights needs no loading."""
    kind = BY_NAME[cfg.drafter_kind]
    drafter = kind.load(cfg.drafter_path, models.target, models.tokenizer, models.device, models.target.dtype)
    models = replace(models, drafter=drafter)
    check_tree_fits(cfg, models)
    return models


def check_tree_fits(cfg: EvalConfig, models: LoadedModels) -> None:
    """A tree's top-k choice index must be below the vocabulary it picks from (the heads', or the
    EAGLE-3 draft's vocabulary), else decoding crashes at its first step; checked once the drafter
    is loaded, before any prompt is decoded."""
    drafter = models.drafter
    kind = BY_NAME[drafter.kind]
    if not kind.supports("tree_vocab") or not cfg.greedy:  # a chain (sampling always runs one)
        return
    tree = tree_choice(drafter, cfg.decode_settings(k=cfg.max_draft_tokens, nodes=cfg.max_tree_nodes))
    if tree is None:
        return
    (name, paths), (vocab, whose) = tree, kind.tree_vocab(drafter)
    if paths == "dynamic":
        if cfg.tree_topk > vocab:
            raise UserError(f"--tree-topk {cfg.tree_topk} exceeds {whose} vocabulary of {vocab} tokens; "
                            f"pass --tree-topk {vocab} or less")
        return
    widest = widest_choice(paths)
    if widest >= vocab:
        raise UserError(f"--tree {name}: a path takes choice {widest} (the top-{widest + 1} token), but {whose} "
                        f"vocabulary has {vocab} tokens; use choice indices below {vocab}")


def bind_engine(cfgs: list[EvalConfig], models: list[LoadedModels], prompts: list[EncodedPrompt]) -> str:
    """Bind the target (once, shared) and every draft model to a cached LM on `--engine`, sized for
    the longest prompt (and, where a plan is made, the `PLAN_PROBE_TOKENS` its probes decode past a
    prompt, whatever --max-new-tokens is); returns the target's engine. `auto` decides per model (a draft the static
    engine cannot run stays eager); an explicit `static` on an unsupported model is an error."""
    first = cfgs[0]
    planning = PLAN_PROBE_TOKENS if any(cfg.planned for cfg in cfgs) else 0  # a plan's probes decode past a prompt
    widest = [cfg.decode_settings(k=cfg.max_draft_tokens, nodes=cfg.max_tree_nodes) for cfg in cfgs]
    max_length = (max(len(p.ids) for p in prompts) + first.max_new_tokens + planning
                  + max(max_step_tokens(m.drafter, s) for s, m in zip(widest, models)))
    target_lm = cached_lm(models[0].target, first.engine, max_length=max_length)
    for cfg, m, s in zip(cfgs, models, widest):
        m.target_lm = target_lm
        # a draft model on its own cached LM; an EAGLE-3 draft beside the target; the rest unchanged
        m.drafter = BY_NAME[m.drafter.kind].bind(m.drafter, target_lm, cfg.engine, max_length, s)
    return target_lm.engine
