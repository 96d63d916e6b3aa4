"""Draft distillation: train a small LM to predict what the target would say, token by token.

The draft learns the target's next-token distribution on the target's own answers to training
prompts (DistillSpec, Zhou et al. 2023). Target logits are computed on the fly from the same
batch (or read from stored top-k, see `topk_teacher_logits`), and a fraction of batches can be
on-policy: continuations sampled from the *current* draft, scored by the target (GKD, Agarwal
et al. 2024), so the draft also learns on the text it actually proposes. Progress is measured
the way it matters: greedy speculative decoding of held-out prompts with drafttrain's own
decoder, whose mean accepted length tau also picks the exported weights.
"""

from __future__ import annotations

import math
import random
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ..config import config_to_dict, documented
from ..data.collate import DistillCollator
from ..data.config import DataConfig
from ..data.generation import cut_at_eos, end_token_ids, left_pad
from ..errors import UserError
from ..fileio import atomic_write_json
from ..losses import LOSSES, distill_loss, topk_forward_kl
from ..models import DTYPES, check_model_path, load_causal_lm, load_tokenizer, resolve_dtype
from .common import (EvalPrompt, expand_vars, greedy_acceptance, prepare_recipe_data, response_window, table_row,
                     validate_common, write_run_config)
from .trainer import OptimConfig, TrainConfig, build_accelerator, is_sharded, train, zero3_init_disabled

LossKind = Literal["forward_kl", "reverse_kl", "jsd", "tvd", "ce"]
assert set(typing.get_args(LossKind)) == set(LOSSES), "LossKind must list drafttrain.losses.LOSSES"


# ----------------------------------------------------------------------------- config


@dataclass
class DraftConfig:
    path: str | None = documented(
        None, doc="An existing small model of the target's family (same tokenizer): a directory or hub id.")
    from_target_layers: str | None = documented(
        None, doc="Or build the draft from a subset of the target's decoder layers: every:N, first:N, a list "
                  "like 0,4,8, or copy:N (N layers that keep the target's copying circuit - its strongest "
                  "induction head and the previous-token head feeding it - whole). Embeddings, final norm and "
                  "LM head are copied too.")
    freeze_embeddings: bool = documented(
        False, doc="Keep the draft's input embeddings and LM head fixed (the target's, when built from its layers): "
                   "a same-family draft already shares them, and the step gets cheaper.")


@dataclass
class LossConfig:
    kind: LossKind = documented(
        "forward_kl", doc="Divergence between target (p) and draft (q): forward_kl KL(p||q), reverse_kl KL(q||p), "
                          "jsd (generalised Jensen-Shannon, see beta), tvd (total variation: 1 - TVD is the "
                          "acceptance probability), ce (cross-entropy on the target's tokens only).")
    beta: float = documented(0.5, doc="jsd only: the mixture weight, sliding from KL(p||q) (near 0) to KL(q||p) (near 1).")
    temperature: float = documented(1.0, doc="Both distributions are softened by this temperature before the loss.")
    chunk_size: int = documented(
        1024, doc="Token positions per chunk of the float32 softmaxes (bounds the loss's peak memory).")


@dataclass
class OnPolicyConfig:
    fraction: float = documented(
        0.0, doc="Fraction of optimizer steps (lambda in GKD) whose batches are continuations sampled from the "
                 "current draft for the batch's prompts, scored by the target on the fly; 0: off.")
    temperature: float = documented(1.0, doc="Sampling temperature of the draft's continuations (0: greedy).")
    max_new_tokens: int | None = documented(
        None, doc="Longest on-policy continuation; default data.max_response_tokens.")


@dataclass
class DistillEvalConfig:
    num_prompts: int = documented(32, doc="Held-out prompts decoded at each evaluation (the first ones).")
    max_new_tokens: int = documented(64, doc="Tokens generated per prompt during evaluation.")
    num_draft_tokens: int = documented(5, doc="K: draft tokens proposed per target verification step.")


@dataclass
class DistillConfig:
    output_dir: str = documented(
        doc="Run directory: config.yaml, train_log.jsonl, checkpoints/, initial/ and final/ drafts, eval/. "
            "Starting again with the same directory resumes the run.")
    target: str = documented(doc="The target model: a local directory or hub id. ${VAR}s are expanded "
                                 "(${DRAFTTRAIN_HOME} defaults to ~/.cache/drafttrain).")
    draft: DraftConfig = documented(default_factory=DraftConfig, doc="Where the draft starts from (give one).")
    target_dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = documented(
        "auto", doc="dtype of the frozen target: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, "
                    "float16, float64. The draft trains in float32 (see train.mixed_precision).")
    export_dtype: Literal["float32", "bfloat16", "float16"] = documented(
        "float32", doc="dtype of the exported draft's weights.")
    data: DataConfig = documented(
        default_factory=DataConfig,
        doc="Prompts and the target's answers to them. With data.store_topk > 0 the loss reads the target's "
            "stored top-k log-probs instead of running the target (an approximation: the rest of the "
            "probability mass is spread evenly over the other tokens); on-policy batches always run it.")
    loss: LossConfig = documented(default_factory=LossConfig, doc="The distillation loss.")
    onpolicy: OnPolicyConfig = documented(default_factory=OnPolicyConfig, doc="On-policy (GKD) batches.")
    optim: OptimConfig = documented(default_factory=OptimConfig, doc="Optimizer and learning-rate schedule.")
    train: TrainConfig = documented(default_factory=TrainConfig, doc="Training loop, checkpoints and logging.")
    eval: DistillEvalConfig = documented(
        default_factory=DistillEvalConfig, doc="Acceptance on held-out prompts: logged, and picks the best weights.")

    def validate(self) -> None:
        """Everything that can be checked without loading a model; raises a one-line UserError."""
        validate_common(self)
        if (self.draft.path is None) == (self.draft.from_target_layers is None):
            raise UserError("give exactly one of draft.path (an existing small model) and draft.from_target_layers "
                            "(e.g. every:5)" + (" - both are set" if self.draft.path else ""))
        if self.draft.path is not None:
            self.draft.path = expand_vars(self.draft.path, "draft.path")
            check_model_path(self.draft.path, "draft")

        if self.loss.kind not in LOSSES:
            raise UserError(f"loss.kind {self.loss.kind!r} is unknown; use one of {', '.join(LOSSES)}")
        if not 0.0 <= self.loss.beta <= 1.0:
            raise UserError(f"loss.beta must be in [0, 1], got {self.loss.beta}")
        if not self.loss.temperature > 0:
            raise UserError(f"loss.temperature must be > 0, got {self.loss.temperature}")
        if self.loss.chunk_size < 1:
            raise UserError(f"loss.chunk_size must be >= 1, got {self.loss.chunk_size}")

        if not 0.0 <= self.onpolicy.fraction <= 1.0:
            raise UserError(f"onpolicy.fraction must be in [0, 1], got {self.onpolicy.fraction}")
        if self.onpolicy.temperature < 0:
            raise UserError(f"onpolicy.temperature must be >= 0 (0 = greedy), got {self.onpolicy.temperature}")
        if self.onpolicy.max_new_tokens is not None and self.onpolicy.max_new_tokens < 1:
            raise UserError(f"onpolicy.max_new_tokens must be >= 1, got {self.onpolicy.max_new_tokens}")
        if self.onpolicy.fraction > 0 and self.loss.kind == "ce":
            raise UserError("onpolicy.fraction > 0 needs the target's distribution, but loss.kind=ce only uses its "
                            "tokens; pick forward_kl, reverse_kl, jsd or tvd, or set onpolicy.fraction=0")

        for key in ("num_prompts", "max_new_tokens", "num_draft_tokens"):
            if getattr(self.eval, key) < 1:
                raise UserError(f"eval.{key} must be >= 1, got {getattr(self.eval, key)}")


# ----------------------------------------------------------------------------- teacher and batches


def topk_teacher_logits(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary teacher logits [B, T, V] from the target's stored top-k log-probs [B, T, k].

    An approximation of the target: its k most likely tokens keep their exact probabilities and
    the remaining mass 1 - sum(top-k) is spread evenly over the other V - k tokens (stored
    log-probs are at temperature 1, so `loss.temperature` applies to this reconstruction). Every
    token keeps some probability, so reverse KL, JSD and TVD stay finite, and forward KL differs
    from the exact one only in how the (small) tail is shaped.
    """
    k = topk_ids.shape[-1]
    logprobs = topk_logprobs.float()
    if k >= vocab_size:
        rest = torch.full_like(logprobs[..., :1], -1e4)
    else:
        tail = (1.0 - logprobs.exp().sum(-1, keepdim=True)).clamp_min(1e-12)
        rest = tail.log() - math.log(vocab_size - k)
    out = rest.expand(*logprobs.shape[:-1], vocab_size).clone()
    return out.scatter_(-1, topk_ids.long().clamp(0, vocab_size - 1), logprobs)


@torch.no_grad()
def onpolicy_batch(draft, batch: dict, collator: DistillCollator, *, temperature: float, max_new_tokens: int,
                   eos_ids: list[int], pad_id: int, seed: int, synced_gpus: bool = False) -> dict:
    """The batch's prompts, each continued by `draft` (sampled, or greedy at temperature 0).

    A prompt ends where its loss mask starts: `loss_mask[t]` is first True at t = len(prompt) - 1
    (pad tokens before it, if the collator aligned prompts, are dropped by the attention mask).
    """
    from transformers import GenerationConfig

    device = batch["input_ids"].device
    starts = batch["loss_mask"].int().argmax(dim=1).tolist()
    prompts = [batch["input_ids"][i, :s + 1][batch["attention_mask"][i, :s + 1].bool()].tolist()
               for i, s in enumerate(starts)]
    input_ids, attention_mask = left_pad(prompts, pad_id, device)
    sampling = temperature > 0
    gen_cfg = GenerationConfig(do_sample=sampling, max_new_tokens=max_new_tokens, eos_token_id=eos_ids,
                               pad_token_id=pad_id, **(dict(temperature=temperature, top_k=0, top_p=1.0)
                                                       if sampling else {}))
    was_training = draft.training
    draft.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = draft.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_cfg,
                                 synced_gpus=synced_gpus)
    finally:
        draft.train(was_training)
    new = out[:, input_ids.shape[1]:].tolist()
    rows = [{"prompt_ids": p, "response_ids": cut_at_eos(r, eos_ids)} for p, r in zip(prompts, new)]
    return {k: v.to(device) for k, v in collator(rows).items()}


def onpolicy_step(fraction: float, seed: int, step: int) -> bool:
    """One draw per optimizer step, the same on every rank and for any process count."""
    return fraction > 0 and random.Random(seed * 1_000_003 + step).random() < fraction


# ----------------------------------------------------------------------------- evaluation


def acceptance(target, draft, prompts: list[EvalPrompt], *, num_draft_tokens: int, max_new_tokens: int,
               eos_token_ids: set[int]) -> dict:
    """Greedy speculative decoding of `prompts` with drafttrain's own decoder: tau and acceptance."""
    from ..decoding import DraftModelProposer, SpeculativeDecoder

    vocab = target.get_output_embeddings().weight.shape[0]
    proposer = DraftModelProposer(draft, vocab, temperature=0.0, top_p=1.0, generator=None)
    decoder = SpeculativeDecoder(target, proposer, num_draft_tokens=num_draft_tokens, temperature=0.0,
                                 eos_token_ids=eos_token_ids)
    return greedy_acceptance(decoder, prompts, max_new_tokens)


# ----------------------------------------------------------------------------- the recipe


def load_models(cfg: DistillConfig, device: torch.device):
    """(tokenizer, target, draft), checked to be usable together; raises UserError otherwise."""
    from ..draft_init import draft_from_target
    from ..preflight import compatibility_checks, require_compatible

    tokenizer = load_tokenizer(cfg.target, "target")
    draft_tok = load_tokenizer(cfg.draft.path, "draft") if cfg.draft.path else tokenizer
    if cfg.draft.path:  # the cheap check first: a foreign vocabulary fails before any weights load
        from ..preflight import first_vocab_difference

        diff = first_vocab_difference(tokenizer.get_vocab(), draft_tok.get_vocab())
        if diff:
            raise UserError(f"draft and target disagree (token-to-id map): {diff}; "
                            "use a draft trained with the target's tokenizer")
    target = load_causal_lm(cfg.target, resolve_dtype(cfg.target_dtype, device), device, "target")
    target.requires_grad_(False)
    if cfg.draft.path:
        draft = load_causal_lm(cfg.draft.path, torch.float32, device, "draft")
    else:
        draft = draft_from_target(target, cfg.draft.from_target_layers).to(torch.float32)
    require_compatible(compatibility_checks(target, tokenizer, draft, draft_tok))
    draft.requires_grad_(True)
    if cfg.draft.freeze_embeddings:
        draft.get_input_embeddings().requires_grad_(False)
        draft.get_output_embeddings().requires_grad_(False)
    draft.train()
    return tokenizer, target, draft



def run_distillation(cfg: DistillConfig) -> dict:
    """The whole recipe; returns a summary (initial/final tau, best step, output paths)."""
    from ..export import export_draft
    from ..preflight import eos_ids

    cfg.validate()
    accelerator = build_accelerator(cfg.train)
    main = accelerator.is_main_process
    out = Path(cfg.output_dir)
    with zero3_init_disabled(accelerator):
        tokenizer, target, draft = load_models(cfg, accelerator.device)

    # Everything is checked: from here on the run writes its directory.
    write_run_config(accelerator, cfg, out)
    if cfg.draft.from_target_layers:
        accelerator.print(f"draft: the target's layers {getattr(draft, 'source_layers', cfg.draft.from_target_layers)}")
    eos_list = end_token_ids(tokenizer, target)
    export_eos = eos_list[0] if len(eos_list) == 1 else eos_list
    base_info = {"target": cfg.target,
                 "draft initialised from": cfg.draft.path or
                 f"the target's layers {cfg.draft.from_target_layers} = {getattr(draft, 'source_layers', '?')}",
                 "recipe": "drafttrain recipes/distill.py"}
    if main and not (out / "initial").is_dir():
        export_draft(draft, tokenizer, out / "initial", eos_token_id=export_eos,
                     base_info={**base_info, "stage": "initial (before distillation)"})

    data, prompts = prepare_recipe_data(accelerator, cfg, tokenizer, target, out)
    accelerator.print(f"{len(data.train)} training examples, {len(data.heldout)} held-out prompts "
                      f"({len(prompts)} used for evaluation)")

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_list[0]
    prompt_weight = cfg.data.prompt_loss_weight
    collator = DistillCollator(cfg.data.max_seq_len, pad_id, align_prompts=True, prompt_positions=prompt_weight > 0)
    target_vocab = target.get_output_embeddings().weight.shape[0]
    synced = is_sharded(accelerator) and accelerator.num_processes > 1
    onpolicy_max_new = cfg.onpolicy.max_new_tokens or cfg.data.max_response_tokens

    def loss_fn(model, batch):
        on = onpolicy_step(cfg.onpolicy.fraction, cfg.train.seed, batch["step"])
        if on:
            batch = onpolicy_batch(accelerator.unwrap_model(model), batch, collator,
                                   temperature=cfg.onpolicy.temperature, max_new_tokens=onpolicy_max_new,
                                   eos_ids=eos_list, pad_id=pad_id, synced_gpus=synced,
                                   seed=cfg.train.seed * 1_000_003 + batch["batch_index"])
        trained = batch["loss_mask"] | batch["prompt_mask"] if prompt_weight > 0 else batch["loss_mask"]
        start = response_window(trained)
        keep = batch["input_ids"].shape[1] - start  # logits only from the first trained position on
        mask = batch["loss_mask"][:, start:]
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        student = model(**inputs, logits_to_keep=keep).logits
        stored = "topk_ids" in batch and not on
        if stored and cfg.loss.kind == "forward_kl" and cfg.loss.temperature == 1.0:
            # The same loss as on topk_teacher_logits, without building the [B, T, V] teacher.
            ids, logprobs = batch["topk_ids"][:, start:], batch["topk_logprobs"][:, start:]
            def divergence(m):
                return topk_forward_kl(student[..., :target_vocab], ids, logprobs, m)
        else:
            if cfg.loss.kind == "ce":
                teacher = None
            elif stored:
                teacher = topk_teacher_logits(batch["topk_ids"][:, start:], batch["topk_logprobs"][:, start:],
                                              target_vocab)
            else:
                with torch.no_grad():
                    teacher = target(**inputs, logits_to_keep=keep).logits
            labels = batch["labels"][:, start:] if cfg.loss.kind == "ce" else None
            def divergence(m):
                return distill_loss(student, teacher, m, kind=cfg.loss.kind, beta=cfg.loss.beta,
                                    temperature=cfg.loss.temperature, chunk_size=cfg.loss.chunk_size, labels=labels)
        loss = divergence(mask)
        logs = {"onpolicy": float(on), "tokens": mask.sum()}
        if prompt_weight > 0:
            prompt_mask = batch["prompt_mask"][:, start:]
            prompt_loss = divergence(prompt_mask)
            loss = loss + prompt_weight * prompt_loss
            logs |= {"prompt_loss": prompt_loss.detach(), "prompt_tokens": prompt_mask.sum()}
        return loss, logs

    target_eos = eos_ids(target, tokenizer)

    def evaluate_fn(model):
        return acceptance(target, model, prompts, num_draft_tokens=cfg.eval.num_draft_tokens,
                          max_new_tokens=cfg.eval.max_new_tokens, eos_token_ids=target_eos)

    result = train(accelerator, draft, data.train, collator, loss_fn, evaluate_fn, cfg.train, cfg.optim, out,
                   run_config=config_to_dict(cfg))

    initial = next(e for e in result.evals if e["step"] == 0)
    final = result.best_metrics
    summary = {"output_dir": str(out), "initial_tau": initial["tau"], "final_tau": final["tau"],
               "best_step": result.best_step, "steps": result.step, "final_dir": str(out / "final")}
    if main:
        rows = [table_row("initial (before training)", initial), table_row(f"final (step {result.best_step})", final)]
        model = result.model.to(DTYPES[cfg.export_dtype])
        export_draft(model, tokenizer, out / "final", eos_token_id=export_eos, acceptance_table=rows,
                     base_info={**base_info, "loss": cfg.loss.kind, "training steps": result.step,
                                "exported weights": f"step {result.best_step} (best held-out tau)"
                                if cfg.train.keep_best else f"step {result.best_step} (last)",
                                "held-out prompts": len(prompts)})
        atomic_write_json(out / "eval" / "initial.json", initial)
        atomic_write_json(out / "eval" / "final.json", final)
        accelerator.print(f"tau {initial['tau']:.3f} -> {final['tau']:.3f} (step {result.best_step}); "
                          f"draft in {out / 'final'}")
    accelerator.wait_for_everyone()
    return summary


__all__ = ["DistillConfig", "DistillEvalConfig", "DraftConfig", "LossConfig", "OnPolicyConfig", "acceptance",
           "onpolicy_batch", "onpolicy_step", "run_distillation", "topk_teacher_logits"]
