"""Train Medusa heads on a target's own outputs: Medusa-1 (frozen target) and Medusa-2 (+ LoRA).

The data is the distillation pipeline's: training prompts answered by the target itself. Head i
(0-based) reads the target's LAST hidden state at position t (post-norm: the state its LM head
reads) and learns the token at t + 2 + i:

    teacher (loss.kind=kl)  the target's logits at t + 1 + i (its distribution for that token)
    label   (loss.kind=ce)  input_ids[t + 2 + i] = the collator's shifted labels[t + 1 + i]
    counted iff             loss_mask[t + 1 + i] (that token is a response token, in the sequence)

so every per-head quantity is the collator's tensor shifted left by 1 + i, and the hidden state
is cut to the same length. `medusa_heads_loss` is that alignment; an off-by-one there would
silently train head i to predict the wrong token, so the tests check it against a brute-force
loop over prefixes.

Medusa-1 (`lora.enabled=false`): the target is frozen, runs outside the trained module (its
hidden states and logits are inputs), and only the heads train, so they work with the unchanged
target. Medusa-2 (`lora.enabled=true`, Cai et al. 2024 section 2.3.2): LoRA adapters on the target
train jointly with the heads, the heads' loss flowing into the adapters, while a language-model
loss keeps the adapted target's next-token distribution close to the original's. The verifier is
then the ADAPTED target: it is exported (merged) to `final/target/` and the heads point at it.

Progress is measured as it matters: greedy Medusa tree decoding (`MedusaDecoder`) of held-out
prompts; its mean accepted length tau picks the exported weights.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from ..config import config_to_dict, documented
from ..data.collate import DistillCollator
from ..data.config import DataConfig
from ..data.generation import end_token_ids
from ..errors import UserError
from ..fileio import atomic_dir, atomic_write_json
from ..losses import distill_loss
from ..models import DTYPES, load_causal_lm, load_tokenizer, resolve_dtype
from ..training.common import (EvalPrompt, greedy_acceptance, prepare_recipe_data, response_window, table_row,
                               validate_common, write_run_config)
from ..training.trainer import OptimConfig, TrainConfig, build_accelerator, train, zero3_init_disabled
from .model import MedusaHeads

# ----------------------------------------------------------------------------- config


@dataclass
class HeadsArchConfig:
    num_heads: int = documented(
        4, doc="Medusa heads. Head i (0-based) reads the target's last hidden state at position t and predicts "
               "the token at t + 2 + i (the target itself predicts t + 1).")
    num_layers: int = documented(
        1, doc="Residual blocks h + SiLU(W h + b) per head (vLLM's num_hidden_layers); they start as the identity.")
    train_lm_heads: bool = documented(
        True, doc="Train each head's own LM head (vocab x hidden, initialised from the target's). false: only the "
                  "residual blocks train (hidden^2 parameters per block): much cheaper, the option for CPU.")


@dataclass
class HeadsLossConfig:
    kind: Literal["kl", "ce"] = documented(
        "kl", doc="kl: self-distillation, KL(target || head) from the target's own distribution for the head's "
                  "token (its logits at t + 1 + i); ce: cross-entropy on the target-generated token t + 2 + i.")
    decay: float = documented(
        0.8, doc="Head i's loss is weighted decay^i (a later head's token is only used when every earlier one "
                 "was accepted); the weights are normalised to sum to 1.")
    chunk_size: int = documented(
        1024, doc="Token positions per chunk of the float32 softmaxes (bounds the loss's peak memory).")


@dataclass
class HeadsLoraConfig:
    enabled: bool = documented(
        False, doc="false: Medusa-1, the target is frozen and only the heads train. true: Medusa-2, LoRA adapters "
                   "on the target (peft) train jointly with the heads; the verifier becomes the adapted target, "
                   "exported merged to final/target/.")
    r: int = documented(8, doc="LoRA rank.")
    alpha: float = documented(16.0, doc="LoRA alpha (the update is scaled by alpha / r).")
    dropout: float = documented(0.05, doc="Dropout on the LoRA branch's input during training.")
    target_modules: list[str] = documented(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        doc="Names of the target's linear layers that get adapters (default: the attention projections of "
            "Llama/Qwen/Mistral-style models; add gate_proj, up_proj, down_proj for the MLPs).")
    lm_loss: Literal["kl", "ce"] = documented(
        "kl", doc="What keeps the adapted target's outputs close to the original's: kl = KL(original || adapted) "
                  "of the next-token distributions at response positions (the original's logits come from a "
                  "second forward with the adapters disabled); ce = cross-entropy on the target-generated tokens "
                  "(no second forward, but it only holds on to the greedy tokens, not the distribution).")
    lm_loss_weight: float = documented(
        1.0, doc="Weight of that language-model loss; the heads' loss has weight 1.")
    heads_warmup_steps: int = documented(
        0, doc="For the first N optimizer steps the heads' loss does not reach the adapters (Medusa-2's "
               "warm-up: fresh heads settle before they pull on the target).")


@dataclass
class HeadsEvalConfig:
    num_prompts: int = documented(16, doc="Held-out prompts decoded at each evaluation (the first ones).")
    max_new_tokens: int = documented(64, doc="Tokens generated per prompt during evaluation.")
    tree_depth: int | None = documented(
        None, doc="Depth of the candidate tree (drafttrain's default Medusa tree cut to this depth, the same "
                  "tree `drafttrain eval --heads` uses with --num-draft-tokens set to it); default: num_heads.")
    tree_nodes: int = documented(
        22, doc="After training, the heads' top-k accuracy is measured on the held-out prompts and the tree with "
                "this many nodes (besides the root) and the largest expected acceptance is stored with them; "
                "`drafttrain eval --tree auto` (the default) uses it. 0: no calibration, keep the default tree.")
    calibration_topk: int = documented(8, doc="Top-k choices per head considered for the calibrated tree.")


@dataclass
class HeadsConfig:
    output_dir: str = documented(
        doc="Run directory: config.yaml, heldout.jsonl, train_log.jsonl, checkpoints/, final/ (heads in vLLM's "
            "format; Medusa-2 also final/target/), eval/. Starting again with the same directory resumes the run.")
    target: str = documented(doc="The target model: a local directory or hub id. ${VAR}s are expanded "
                                 "(${DRAFTTRAIN_HOME} defaults to ~/.cache/drafttrain).")
    target_dtype: str = documented(
        "auto", doc="dtype of the target: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16, "
                    "float64. The heads (and LoRA adapters) train in float32 (see train.mixed_precision).")
    export_dtype: str = documented("float32", doc="dtype of the exported heads: float32, bfloat16, float16.")
    heads: HeadsArchConfig = documented(default_factory=HeadsArchConfig, doc="The heads' shape and what trains.")
    loss: HeadsLossConfig = documented(default_factory=HeadsLossConfig, doc="The heads' loss.")
    lora: HeadsLoraConfig = documented(default_factory=HeadsLoraConfig, doc="Medusa-2: LoRA on the target.")
    data: DataConfig = documented(default_factory=DataConfig, doc="Prompts and the target's answers to them.")
    optim: OptimConfig = documented(default_factory=OptimConfig, doc="Optimizer and learning-rate schedule.")
    train: TrainConfig = documented(default_factory=TrainConfig, doc="Training loop, checkpoints and logging.")
    eval: HeadsEvalConfig = documented(
        default_factory=HeadsEvalConfig, doc="Acceptance on held-out prompts: logged, and picks the best weights.")

    def validate(self) -> None:
        """Everything that can be checked without loading a model; raises a one-line UserError."""
        validate_common(self)
        if self.data.prompt_loss_weight:
            raise UserError("data.prompt_loss_weight is a distillation setting; heads train on response positions "
                            "only, so set data.prompt_loss_weight=0")
        if self.heads.num_heads < 1:
            raise UserError(f"heads.num_heads must be >= 1, got {self.heads.num_heads}")
        if self.heads.num_layers < 0:
            raise UserError(f"heads.num_layers must be >= 0, got {self.heads.num_layers}")
        if self.heads.num_layers == 0 and not self.heads.train_lm_heads:
            raise UserError("with heads.num_layers=0 and heads.train_lm_heads=false nothing would train; "
                            "set heads.num_layers >= 1 or heads.train_lm_heads=true")
        if not 0.0 < self.loss.decay <= 1.0:
            raise UserError(f"loss.decay must be in (0, 1], got {self.loss.decay}")
        if self.loss.chunk_size < 1:
            raise UserError(f"loss.chunk_size must be >= 1, got {self.loss.chunk_size}")
        self._validate_lora()

        for key in ("num_prompts", "max_new_tokens"):
            if getattr(self.eval, key) < 1:
                raise UserError(f"eval.{key} must be >= 1, got {getattr(self.eval, key)}")
        if self.eval.tree_nodes < 0:
            raise UserError(f"eval.tree_nodes must be >= 0 (0 = no calibrated tree), got {self.eval.tree_nodes}")
        if self.eval.calibration_topk < 1:
            raise UserError(f"eval.calibration_topk must be >= 1, got {self.eval.calibration_topk}")
        if self.eval.tree_depth is not None and not 1 <= self.eval.tree_depth <= self.heads.num_heads:
            raise UserError(f"eval.tree_depth must be between 1 and heads.num_heads ({self.heads.num_heads}), "
                            f"got {self.eval.tree_depth}")

    def _validate_lora(self) -> None:
        lora = self.lora
        if not lora.enabled:
            default = HeadsLoraConfig()
            changed = [f.name for f in fields(lora) if getattr(lora, f.name) != getattr(default, f.name)]
            if changed:
                raise UserError(f"lora.{changed[0]} is set but lora.enabled is false (Medusa-1 trains no adapters); "
                                "set lora.enabled=true for Medusa-2 or drop the lora options")
            return
        if lora.r < 1:
            raise UserError(f"lora.r must be >= 1, got {lora.r}")
        if not lora.alpha > 0:
            raise UserError(f"lora.alpha must be > 0, got {lora.alpha}")
        if not 0.0 <= lora.dropout < 1.0:
            raise UserError(f"lora.dropout must be in [0, 1), got {lora.dropout}")
        if not lora.target_modules:
            raise UserError("lora.target_modules is empty; name the target's linear layers, e.g. [q_proj, v_proj]")
        if lora.lm_loss_weight < 0:
            raise UserError(f"lora.lm_loss_weight must be >= 0, got {lora.lm_loss_weight}")
        if lora.heads_warmup_steps < 0:
            raise UserError(f"lora.heads_warmup_steps must be >= 0, got {lora.heads_warmup_steps}")

    @property
    def kind(self) -> str:
        return "medusa-2" if self.lora.enabled else "medusa-1"


# ----------------------------------------------------------------------------- the loss


def medusa_heads_loss(heads: MedusaHeads, hidden: torch.Tensor, loss_mask: torch.Tensor, labels: torch.Tensor, *,
                      kind: str, decay: float, teacher_logits: torch.Tensor | None = None,
                      chunk_size: int = 1024) -> tuple[torch.Tensor, dict]:
    """Weighted mean over heads of each head's mean loss over the tokens it can learn.

    hidden [B, T, H]: the target's last (post-norm) hidden states; loss_mask, labels [B, T]: the
    collator's (labels already shifted: labels[s] = input_ids[s + 1]); teacher_logits [B, T, V]:
    the target's logits (kind "kl" only). Head i at t is compared with row t + 1 + i of those
    (see the module docstring), and only the rows that count are pushed through the head.
    Logs per head: its loss and its top-1 agreement with the target's token.
    """
    if kind not in ("kl", "ce"):
        raise ValueError(f"unknown heads loss {kind!r}; use kl or ce")
    if kind == "kl" and teacher_logits is None:
        raise ValueError("the kl heads loss needs the target's logits")
    T = hidden.shape[1]
    dtype = heads.lm_heads[0].weight.dtype
    weights = [decay ** i for i in range(heads.config.num_heads)]
    total, logs = 0.0, {}
    for i, w in enumerate(weights):
        L = max(T - 1 - i, 0)                   # positions t whose token t + 2 + i can exist
        mask = loss_mask[:, 1 + i:1 + i + L].bool()
        rows = hidden[:, :L][mask].to(dtype)    # [N, H]
        logits = heads.forward_head(i, rows)    # [N, V]
        ones = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        tokens = labels[:, 1 + i:1 + i + L][mask]
        if kind == "kl":
            teacher = teacher_logits[:, 1 + i:1 + i + L][mask]
            loss_i = distill_loss(logits, teacher, ones, kind="forward_kl", chunk_size=chunk_size)
        else:
            loss_i = distill_loss(logits, None, ones, kind="ce", labels=tokens, chunk_size=chunk_size)
        total = total + w * loss_i
        logs[f"head{i}_loss"] = loss_i.detach()
        with torch.no_grad():
            logs[f"head{i}_top1"] = (logits.argmax(-1) == tokens).float().mean() if len(tokens) else 0.0
    return total / sum(weights), logs


class HeadsObjective(nn.Module):
    """Medusa-1's trained module: the heads alone. The frozen target's outputs are its inputs, so
    the target can stay outside (no DDP wrapper, no optimizer state, no checkpoint copies)."""

    def __init__(self, heads: MedusaHeads, loss: HeadsLossConfig):
        super().__init__()
        self.heads = heads
        self.loss_cfg = loss

    def forward(self, hidden, loss_mask, labels, teacher_logits=None):
        return medusa_heads_loss(self.heads, hidden, loss_mask, labels, kind=self.loss_cfg.kind,
                                 decay=self.loss_cfg.decay, teacher_logits=teacher_logits,
                                 chunk_size=self.loss_cfg.chunk_size)


class JointObjective(nn.Module):
    """Medusa-2's trained module: the LoRA-adapted target (a peft model) and the heads.

    loss = heads loss (on the adapted target's hidden states, so it trains the adapters too)
         + lm_loss_weight * lm loss (KL(original || adapted), or CE on the target's tokens).
    With loss.kind=kl the heads' teacher is the ORIGINAL target's distribution (the same
    adapters-off forward the lm loss uses): a fixed teacher the adapted target is held close to.
    """

    def __init__(self, target, heads: MedusaHeads, loss: HeadsLossConfig, lora: HeadsLoraConfig):
        super().__init__()
        self.target = target
        self.heads = heads
        self.loss_cfg, self.lora_cfg = loss, lora

    def forward(self, input_ids, attention_mask, loss_mask, labels, heads_reach_target: bool = True,
                position_ids=None):
        out = self.target(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states[-1]
        if not heads_reach_target:  # same values, zero gradient: the graph (and DDP) still see every parameter
            hidden = hidden.detach() + 0.0 * hidden
        original = None
        if self.loss_cfg.kind == "kl" or self.lora_cfg.lm_loss == "kl":
            with torch.no_grad(), self.target.disable_adapter():
                original = self.target(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       use_cache=False).logits
        heads_loss, logs = medusa_heads_loss(self.heads, hidden, loss_mask, labels, kind=self.loss_cfg.kind,
                                             decay=self.loss_cfg.decay, teacher_logits=original,
                                             chunk_size=self.loss_cfg.chunk_size)
        if self.lora_cfg.lm_loss == "kl":
            lm = distill_loss(out.logits, original, loss_mask, kind="forward_kl", chunk_size=self.loss_cfg.chunk_size)
        else:
            lm = distill_loss(out.logits, None, loss_mask, kind="ce", labels=labels,
                              chunk_size=self.loss_cfg.chunk_size)
        logs |= {"heads_loss": heads_loss.detach(), "lm_loss": lm.detach()}
        return heads_loss + self.lora_cfg.lm_loss_weight * lm, logs


# ----------------------------------------------------------------------------- evaluation


def heads_acceptance(target, heads: MedusaHeads, prompts: list[EvalPrompt], *, tree_depth: int,
                     max_new_tokens: int, eos_token_ids: set[int], tree: list | None = None) -> dict:
    """Greedy Medusa tree decoding of `prompts`: tau, acceptance and per-head acceptance (with
    `tree`, or the default tree cut to `tree_depth`)."""
    from ..decoding.medusa import MedusaDecoder
    from .tree import default_tree

    decoder = MedusaDecoder(target, heads, tree=tree or default_tree(tree_depth), temperature=0.0,
                            eos_token_ids=eos_token_ids)
    return greedy_acceptance(decoder, prompts, max_new_tokens, extra={"tree_nodes": decoder.num_tree_nodes})


# ----------------------------------------------------------------------------- the recipe


def check_last_hidden_state(target) -> None:
    """The heads must read the state the LM head reads (post-norm). transformers 5.x returns it as
    `hidden_states[-1]`; a model that returns the pre-norm state would train useless heads."""
    lm_head = target.get_output_embeddings()
    vocab = lm_head.weight.shape[0]
    device = lm_head.weight.device
    ids = (torch.arange(16, device=device) * 7 + 3) % vocab
    with torch.no_grad():
        out = target(input_ids=ids[None], output_hidden_states=True, use_cache=False)
        agree = (lm_head(out.hidden_states[-1]).argmax(-1) == out.logits.argmax(-1)).float().mean().item()
    if agree < 0.9:
        raise UserError(f"this target's hidden_states[-1] is not what its LM head reads (the argmax agrees at only "
                        f"{agree:.0%} of positions); Medusa heads need a model that returns its final, post-norm "
                        "hidden state there")


def fresh_heads(target, cfg: HeadsArchConfig) -> MedusaHeads:
    try:
        heads = MedusaHeads.from_target(target, num_heads=cfg.num_heads, num_layers=cfg.num_layers)
    except ValueError as e:
        raise UserError(f"cannot build Medusa heads for this target: {e}") from e
    heads = heads.to(torch.float32)
    heads.requires_grad_(True)
    if not cfg.train_lm_heads:
        heads.lm_heads.requires_grad_(False)
    return heads


def check_lora_modules(target, names: list[str]) -> None:
    """Fail before any work if an adapter would have no layer to sit on (peft's suffix matching)."""
    linear = {n.rsplit(".", 1)[-1] for n, m in target.named_modules() if isinstance(m, nn.Linear)}
    missing = [n for n in names if n not in linear]
    if missing:
        raise UserError(f"lora.target_modules {missing} name no linear layer of the target; its linear layers are "
                        f"{sorted(linear)}")


def add_lora(target, cfg: HeadsLoraConfig):
    from peft import LoraConfig, get_peft_model

    peft_cfg = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(target, peft_cfg)


def run_heads_training(cfg: HeadsConfig) -> dict:
    """The whole recipe; returns a summary (initial/final tau, best step, output paths)."""
    from ..preflight import eos_ids

    cfg.validate()
    accelerator = build_accelerator(cfg.train)
    main = accelerator.is_main_process
    out = Path(cfg.output_dir)
    device = accelerator.device
    with zero3_init_disabled(accelerator):
        tokenizer = load_tokenizer(cfg.target, "target")
        target = load_causal_lm(cfg.target, resolve_dtype(cfg.target_dtype, device), device, "target")
    target.requires_grad_(False)
    check_last_hidden_state(target)
    if cfg.lora.enabled:
        check_lora_modules(target, cfg.lora.target_modules)
    heads = fresh_heads(target, cfg.heads).to(device)

    # Everything is checked: from here on the run writes its directory.
    write_run_config(accelerator, cfg, out)

    data, prompts = prepare_recipe_data(accelerator, cfg, tokenizer, target, out)
    accelerator.print(f"{len(data.train)} training examples, {len(data.heldout)} held-out prompts "
                      f"({len(prompts)} used for evaluation); training {cfg.kind} heads")

    eos_list = end_token_ids(tokenizer, target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_list[0]
    collator = DistillCollator(cfg.data.max_seq_len, pad_id, align_prompts=True)

    if cfg.lora.enabled:  # after the data: the target answered the prompts as it was
        module = JointObjective(add_lora(target, cfg.lora), heads, cfg.loss, cfg.lora)

        def loss_fn(model, batch):
            return model(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch["labels"],
                         heads_reach_target=batch["step"] >= cfg.lora.heads_warmup_steps,
                         position_ids=batch["position_ids"])
    else:
        module = HeadsObjective(heads, cfg.loss)

        def loss_fn(model, batch):
            # Nothing before the first trained position counts: the target's LM head skips it.
            start = response_window(batch["loss_mask"])
            keep = batch["input_ids"].shape[1] - start if cfg.loss.kind == "kl" else 1
            with torch.no_grad():
                o = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"], output_hidden_states=True, use_cache=False,
                           logits_to_keep=keep)
            teacher = o.logits if cfg.loss.kind == "kl" else None
            return model(o.hidden_states[-1][:, start:], batch["loss_mask"][:, start:], batch["labels"][:, start:],
                         teacher)

    target_eos = eos_ids(target, tokenizer)
    depth = cfg.eval.tree_depth or cfg.heads.num_heads

    def evaluate_fn(model):
        verifier = model.target if cfg.lora.enabled else target  # Medusa-2: adapters on
        return heads_acceptance(verifier, model.heads, prompts, tree_depth=depth,
                                max_new_tokens=cfg.eval.max_new_tokens, eos_token_ids=target_eos)

    result = train(accelerator, module, data.train, collator, loss_fn, evaluate_fn, cfg.train, cfg.optim, out,
                   run_config=config_to_dict(cfg))

    initial = next(e for e in result.evals if e["step"] == 0)
    final = result.best_metrics
    summary = {"output_dir": str(out), "kind": cfg.kind, "initial_tau": initial["tau"], "final_tau": final["tau"],
               "best_step": result.best_step, "steps": result.step, "final_dir": str(out / "final")}
    calibrated = None
    if main and cfg.eval.tree_nodes:
        calibrated = calibrate_tree(result.model, cfg, target, prompts, depth, eos_list, target_eos)
        accelerator.print(f"calibrated tree: {cfg.eval.tree_nodes} nodes, held-out tau {calibrated['tau']:.3f} "
                          f"(default tree {final['tau']:.3f})")
    if main:
        export_final(result.model, cfg, tokenizer, out / "final", result.step, result.best_step, initial, final,
                     len(prompts), calibrated=calibrated)
        atomic_write_json(out / "eval" / "initial.json", initial)
        atomic_write_json(out / "eval" / "final.json", final)
        if calibrated:
            atomic_write_json(out / "eval" / "calibrated.json", calibrated)
        accelerator.print(f"tau {initial['tau']:.3f} -> {final['tau']:.3f} (step {result.best_step}); "
                          f"heads in {out / 'final'}")
    accelerator.wait_for_everyone()
    return summary


def calibrate_tree(module: nn.Module, cfg: HeadsConfig, target, prompts: list[EvalPrompt], depth: int,
                   eos_list: list[int], target_eos: set[int]) -> dict:
    """The trained heads' top-k accuracy on the held-out prompts, the tree it implies, and that
    tree's held-out acceptance: {"topk_accuracy", "tree", **acceptance metrics}."""
    from .calibrate import head_topk_accuracy
    from .tree import tree_from_accuracies

    module.eval()  # LoRA dropout off, as in every evaluation
    verifier = module.target if cfg.lora.enabled else target
    accuracy = head_topk_accuracy(verifier, module.heads, [p.ids for p in prompts], topk=cfg.eval.calibration_topk,
                                  max_new_tokens=cfg.eval.max_new_tokens, eos_token_ids=eos_list)
    tree = tree_from_accuracies(accuracy[:depth], cfg.eval.tree_nodes)
    metrics = heads_acceptance(verifier, module.heads, prompts, tree_depth=depth, tree=tree,
                               max_new_tokens=cfg.eval.max_new_tokens, eos_token_ids=target_eos)
    return {**metrics, "topk_accuracy": accuracy, "tree": [list(p) for p in tree]}


# ----------------------------------------------------------------------------- export


def export_final(module: nn.Module, cfg: HeadsConfig, tokenizer, final_dir: Path, steps: int, best_step: int,
                 initial: dict, final: dict, num_prompts: int, calibrated: dict | None = None) -> None:
    """final/: the heads in vLLM's format (with the calibrated tree, if any); Medusa-2 also target/,
    the merged adapted target (the verifier). Written into one temporary directory and renamed,
    so heads never point at a half-written verifier."""
    from ..export import render_acceptance_table
    from .export import save_medusa

    final_dir = Path(final_dir)
    heads = copy.deepcopy(module.heads).to(device="cpu", dtype=DTYPES[cfg.export_dtype])
    verifier = str((final_dir / "target").resolve()) if cfg.lora.enabled else None
    info = {"kind": cfg.kind, "target": cfg.target, **({"verifier": verifier} if verifier else {})}
    rows = [table_row("fresh heads (before training)", initial), table_row(f"trained (step {best_step})", final)]
    if calibrated:
        info |= {"tree": calibrated["tree"], "topk_accuracy": calibrated["topk_accuracy"]}
        rows.append(table_row(f"trained, calibrated tree ({len(calibrated['tree'])} nodes)", calibrated))
    with atomic_dir(final_dir, overwrite=True) as tmp:
        save_medusa(heads, tmp, extra={"drafttrain": info, "base_model": verifier or cfg.target},
                    card_notes=_card_notes(cfg, steps, best_step, num_prompts, render_acceptance_table(rows)))
        if cfg.lora.enabled:
            merged = copy.deepcopy(module.target).merge_and_unload().to("cpu")
            merged.save_pretrained(tmp / "target")
            tokenizer.save_pretrained(tmp / "target")
            (tmp / "target" / "README.md").write_text(
                f"# Adapted target (Medusa-2)\n\n`{cfg.target}` with the LoRA adapters (r={cfg.lora.r}, "
                f"modules {', '.join(cfg.lora.target_modules)}) trained jointly with the Medusa heads in `..`, "
                "merged into its weights. It is the verifier those heads were trained for: pass this directory "
                "as --target.\n")


def _card_notes(cfg: HeadsConfig, steps: int, best_step: int, num_prompts: int, table: str) -> str:
    lines = ["## Training", "",
             f"- **method**: {cfg.kind} (" + ("LoRA adapters on the target trained jointly with the heads"
                                              if cfg.lora.enabled else "target frozen, only the heads trained") + ")",
             f"- **target**: `{cfg.target}`",
             f"- **heads loss**: {cfg.loss.kind}" + (" (self-distillation from the target's own distribution)"
                                                      if cfg.loss.kind == "kl" else " (on the target's tokens)")
             + f", head i weighted {cfg.loss.decay}^i",
             f"- **LM heads trained**: {'yes' if cfg.heads.train_lm_heads else 'no (residual blocks only)'}",
             f"- **training steps**: {steps}; exported weights: step {best_step} "
             + ("(best held-out tau)" if cfg.train.keep_best else "(last)")]
    if cfg.lora.enabled:
        lines.append(f"- **LoRA**: r={cfg.lora.r}, alpha={cfg.lora.alpha}, modules "
                     f"{', '.join(cfg.lora.target_modules)}; language-model loss {cfg.lora.lm_loss} x "
                     f"{cfg.lora.lm_loss_weight}")
        lines += ["", "**The verifier is the adapted target** in `target/` next to these heads (the LoRA adapters "
                      "merged), not the original target: use it as the target, e.g. `drafttrain eval --target "
                      "<this directory>/target --heads <this directory> ...`, or as the model in vLLM."]
    lines += ["", f"## Acceptance (greedy tree decoding, {num_prompts} held-out prompts)", "", table.rstrip("\n")]
    return "\n".join(lines)


__all__ = ["HeadsArchConfig", "HeadsConfig", "HeadsEvalConfig", "HeadsLoraConfig", "HeadsLossConfig",
           "HeadsObjective", "JointObjective", "export_final", "heads_acceptance", "medusa_heads_loss",
           "run_heads_training"]
