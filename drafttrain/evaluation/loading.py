"""Loading what an evaluation decodes with, once: the target, each drafter, and their engines.

Every model is checked as it loads (a damaged file, non-finite weights, a drafter made for another
target are one `error:` line). The target and each draft model are then bound to ONE cached LM
each (`--engine`), sized for the longest prompt and shared by every decoder of the run, so steps
are compiled and captured once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..decoding import CachedLM, Drafter, cached_lm
from ..decoding.drafters.eagle3 import cached_draft_for
from ..decoding.drafters.eagle3_cache import CachedEagle3Draft
from ..decoding.factory import DYNAMIC_TREE_NODES, max_step_tokens, tree_choice
from ..eagle3.export import load_eagle3
from ..eagle3.model import Eagle3Draft
from ..errors import UserError
from ..medusa.export import load_medusa, read_heads_info
from ..models import first_line, load_causal_lm, load_tokenizer, resolve_device, resolve_dtype
from ..parallel import check_parallel_config, parallel_info
from ..preflight import compatibility_checks, require_compatible
from ..prompts import EncodedPrompt
from ..tokens import eos_token_ids
from ..trees import widest_choice
from .config import PLAN_PROBE_TOKENS, EvalConfig


@dataclass
class LoadedModels:
    """Everything one evaluation needs, loaded and checked once."""

    target: torch.nn.Module
    tokenizer: object
    device: torch.device
    eos: set[int]
    draft: torch.nn.Module | None = None
    heads: torch.nn.Module | None = None
    heads_info: dict = field(default_factory=dict)
    eagle3: Eagle3Draft | None = None
    eagle3_info: dict = field(default_factory=dict)
    target_lm: CachedLM | None = None  # the engine-bound models (`bind_engine`), shared by every decoder
    draft_lm: CachedLM | None = None
    eagle3_lm: CachedEagle3Draft | None = None
    served: object | None = None  # --backend vllm: the run's vLLM engines (`vllm_backend.ServedEngines`)

    @property
    def dtype_name(self) -> str:
        return str(self.target.dtype).removeprefix("torch.")

    def drafter(self, kind: str) -> Drafter:
        """The factory's view of the drafter of this `kind` (bound to its engine where it has one)."""
        if kind == "draft":
            parallel = parallel_info(self.draft.config)  # SPEC §7: a parallel draft names its pard_token
            if parallel:
                return Drafter("parallel_draft", self.draft_lm or self.draft, parallel)
            return Drafter("draft", self.draft_lm or self.draft)
        if kind == "medusa":
            return Drafter("medusa", self.heads, self.heads_info)
        if kind == "eagle3":
            return Drafter("eagle3", self.eagle3_lm or self.eagle3, self.eagle3_info)
        return Drafter(kind)


def load_models(cfg: EvalConfig) -> LoadedModels:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    tokenizer = load_tokenizer(cfg.target, "target")
    draft_tok = load_tokenizer(cfg.draft, "draft") if cfg.draft else None
    target = load_causal_lm(cfg.target, dtype, device, "target")
    models = LoadedModels(target=target, tokenizer=tokenizer, device=device, eos=set(eos_token_ids(tokenizer, target)))
    return attach_drafter(models, cfg, draft_tok)


def attach_drafter(models: LoadedModels, cfg: EvalConfig, draft_tok=None) -> LoadedModels:
    """Load cfg's draft model, heads or EAGLE-3 draft next to the target, after checking they fit it."""
    dtype = models.target.dtype
    if cfg.draft:
        draft_tok = draft_tok or load_tokenizer(cfg.draft, "draft")
        models.draft = load_causal_lm(cfg.draft, dtype, models.device, "draft")
        check_parallel_config(models.draft, cfg.draft)
        require_compatible(compatibility_checks(models.target, models.tokenizer, models.draft, draft_tok))
    if cfg.heads:
        models.heads = load_heads(cfg.heads, models.device, dtype)
        models.heads_info = read_heads_info(cfg.heads)
    if cfg.eagle3:
        models.eagle3, info = load_eagle3(cfg.eagle3, device=models.device, dtype=dtype,
                                          target_config=models.target.config)
        require_finite(models.eagle3, "EAGLE-3 draft", cfg.eagle3)
        models.eagle3.attach_embeddings(models.target.get_input_embeddings())
        models.eagle3.eval()
        models.eagle3_info = {"aux_layer_ids": list(info.aux_layer_ids), "draft_vocab_size": info.draft_vocab_size,
                              **(info.config.get("drafttrain") or {})}
    check_tree_fits(cfg, models)
    return models


def check_tree_fits(cfg: EvalConfig, models: LoadedModels) -> None:
    """A tree's top-k choice index must be below the vocabulary it picks from (the heads', or the
    EAGLE-3 draft's vocabulary), else decoding crashes at its first step; checked once the drafter
    is loaded, before any prompt is decoded."""
    kind = cfg.drafter_kind
    if kind not in ("medusa", "eagle3"):
        return
    tree = tree_choice(models.drafter(kind), cfg.decode_settings(k=cfg.max_draft_tokens, nodes=cfg.max_tree_nodes))
    if tree is None or not cfg.greedy:  # a chain (sampling always runs one)
        return
    name, paths = tree
    if kind == "medusa":
        vocab, whose = models.heads.config.vocab_size, "the Medusa heads'"
    else:
        vocab, whose = models.eagle3.config.draft_vocab_size, "the EAGLE-3 draft's"
    if paths == "dynamic":
        if cfg.tree_topk > vocab:
            raise UserError(f"--tree-topk {cfg.tree_topk} exceeds the EAGLE-3 draft's vocabulary of {vocab} tokens; "
                            f"pass --tree-topk {vocab} or less")
        return
    widest = widest_choice(paths)
    if widest >= vocab:
        raise UserError(f"--tree {name}: a path takes choice {widest} (the top-{widest + 1} token), but {whose} "
                        f"vocabulary has {vocab} tokens; use choice indices below {vocab}")


def require_finite(module: torch.nn.Module, what: str, path: str) -> None:
    bad = next((name for name, p in module.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if bad is not None:
        raise UserError(f"the {what} at {path!r} has non-finite weights (NaN or inf in {bad}); the file is damaged: "
                        "export it again")


def load_heads(path: str, device: torch.device, dtype: torch.dtype):
    """Medusa heads, or one UserError line for a damaged weights file or non-finite weights."""
    try:
        heads = load_medusa(path, device=device, dtype=dtype)
    except UserError:
        raise
    except Exception as e:  # safetensors' SafetensorError (truncated or empty file), a bad pickle, ...
        raise UserError(f"cannot load the Medusa heads from {path!r}: their weights file is damaged "
                        f"({first_line(e)}); export the heads again") from e
    require_finite(heads, "Medusa heads", path)
    return heads


def bind_engine(cfgs: list[EvalConfig], models: list[LoadedModels], prompts: list[EncodedPrompt]) -> str:
    """Bind the target (once, shared) and every draft model to a cached LM on `--engine`, sized for
    the longest prompt (and, where a plan is made, the `PLAN_PROBE_TOKENS` its probes decode past a
    prompt, whatever --max-new-tokens is); returns the target's engine. `auto` decides per model (a draft the static
    engine cannot run stays eager); an explicit `static` on an unsupported model is an error."""
    first = cfgs[0]
    planning = PLAN_PROBE_TOKENS if any(cfg.planned for cfg in cfgs) else 0  # a plan's probes decode past a prompt
    max_length = (max(len(p.ids) for p in prompts) + first.max_new_tokens + planning
                  + max(max_step_tokens(m.drafter(cfg.drafter_kind), cfg.decode_settings(k=cfg.max_draft_tokens,
                                                                                           nodes=cfg.max_tree_nodes))
                        for cfg, m in zip(cfgs, models)))
    target_lm = cached_lm(models[0].target, first.engine, max_length=max_length)
    for cfg, m in zip(cfgs, models):
        m.target_lm = target_lm
        if m.draft is not None:
            m.draft_lm = cached_lm(m.draft, cfg.engine, max_length=max_length)
        if m.eagle3 is not None:  # the draft layer follows the target: static (compiled) beside static
            m.eagle3_lm = cached_draft_for(target_lm, m.eagle3, num_draft_tokens=cfg.max_draft_tokens,
                                               tree_nodes=cfg.max_tree_nodes or DYNAMIC_TREE_NODES,
                                               tree_topk=cfg.tree_topk)
    return target_lm.engine
