"""Train Medusa heads on a target (SPEC §4): Medusa-1, or Medusa-2 with lora.enabled=true.

    accelerate launch recipes/train_heads.py --config recipes/configs/NAME.yaml [--overwrite] [key=value ...]
    python recipes/train_heads.py --config recipes/configs/NAME.yaml [key=value ...]

`--help` lists every config key. Bad input prints one `error:` line and exits with status 2.

The story of the run (the shared steps are `drafttrain.training.recipe.Recipe.run`):

1. Load the target and put fresh heads on it (each a copy of the target's LM head behind
   residual blocks that start as the identity). The heads must read the state the LM head
   reads, which is checked first.
2. The target answers the training prompts itself (the distillation data pipeline, cached).
3. Train. Medusa-1 (`lora.enabled=false`): the target is frozen and runs outside the trained
   module (its hidden states and logits are inputs), only the heads train, so they work with the
   unchanged target. Medusa-2 (`lora.enabled=true`, Cai et al. 2024 section 2.3.2): LoRA adapters
   on the target train jointly with the heads, while a language-model loss keeps the adapted
   target's outputs close to the original's. The loss and the alignment of head i with token
   t + 2 + i are `drafttrain.kinds.medusa.loss`.
4. Measure what matters: greedy Medusa tree decoding of held-out prompts; tau picks the exported
   weights. After training, the heads' top-k accuracy on those prompts shapes a calibrated tree.
5. Export the heads in vLLM's Medusa format to `final/` (SPEC §3), with the calibrated tree; for
   Medusa-2 the verifier is the ADAPTED target, exported merged to `final/target/`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import nn

from drafttrain.config import setting
from drafttrain.data import response_window
from drafttrain.decoding import DecodeSettings
from drafttrain.kinds.base import Drafter
from drafttrain.errors import UserError
from drafttrain.evaluation.plan import export_plans, planned_k
from drafttrain.kinds.medusa.calibrate import head_topk_accuracy
from drafttrain.kinds.medusa.export import export_final
from drafttrain.kinds.medusa.loss import HeadsObjective, JointObjective
from drafttrain.kinds.medusa.model import MedusaHeads
from drafttrain.trees import chain_tree, tree_from_accuracies
from drafttrain.prompts import EncodedPrompt
from drafttrain.tokens import output_vocab_size
from drafttrain.training.acceptance import held_out_acceptance, table_row
from drafttrain.training.recipe import (Recipe, RecipeConfig, RecipeEvalConfig, exit_with, held_out_eval,
                                         recipe_main, run_directory)

# ----------------------------------------------------------------------------- config


@dataclass
class HeadsArchConfig:
    num_heads: int = setting(
        4, doc="Medusa heads. Head i (0-based) reads the target's last hidden state at position t and predicts "
               "the token at t + 2 + i (the target itself predicts t + 1).", at_least=1)
    num_layers: int = setting(
        1, doc="Residual blocks h + SiLU(W h + b) per head (vLLM's num_hidden_layers); they start as the identity.",
        at_least=0)
    train_lm_heads: bool = setting(
        True, doc="Train each head's own LM head (vocab x hidden, initialised from the target's). false: only the "
                  "residual blocks train (hidden^2 parameters per block): much cheaper, the option for CPU.")
    share_lm_head: bool = setting(
        False, doc="One LM head (a copy of the target's) behind every head's residual blocks instead of one per "
                   "head: for large vocabularies, where a vocab x hidden head per Medusa head is most of the "
                   "heads' memory, export and draft cost. Exported as vLLM's original_lm_head.")


@dataclass
class HeadsLossConfig:
    kind: Literal["kl", "ce"] = setting(
        "kl", doc="kl: self-distillation, KL(target || head) from the target's own distribution for the head's "
                  "token (its logits at t + 1 + i); ce: cross-entropy on the target-generated token t + 2 + i.")
    decay: float = setting(
        0.8, doc="Head i's loss is weighted decay^i (a later head's token is only used when every earlier one "
                 "was accepted); the weights are normalised to sum to 1.", above=0, at_most=1)
    chunk_size: int = setting(
        1024, doc="Token positions per chunk of the float32 softmaxes (bounds the loss's peak memory).", at_least=1)


@dataclass
class HeadsLoraConfig:
    enabled: bool = setting(
        False, doc="false: Medusa-1, the target is frozen and only the heads train. true: Medusa-2, LoRA adapters "
                   "on the target (peft, `pip install 'drafttrain[heads]'`) train jointly with the heads; the "
                   "verifier becomes the adapted target, exported merged to final/target/.")
    r: int = setting(8, doc="LoRA rank.", at_least=1)
    alpha: float = setting(16.0, doc="LoRA alpha (the update is scaled by alpha / r).", above=0)
    dropout: float = setting(0.05, doc="Dropout on the LoRA branch's input during training.", at_least=0, below=1)
    target_modules: list[str] = setting(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        doc="Names of the target's linear layers that get adapters (default: the attention projections of "
            "Llama/Qwen/Mistral-style models; add gate_proj, up_proj, down_proj for the MLPs).")
    lm_loss: Literal["kl", "ce"] = setting(
        "kl", doc="What keeps the adapted target's outputs close to the original's: kl = KL(original || adapted) "
                  "of the next-token distributions at response positions (the original's logits come from a "
                  "second forward with the adapters disabled); ce = cross-entropy on the target-generated tokens "
                  "(no second forward, but it only holds on to the greedy tokens, not the distribution).")
    lm_loss_weight: float = setting(
        1.0, doc="Weight of that language-model loss; the heads' loss has weight 1.", at_least=0)
    heads_warmup_steps: int = setting(
        0, doc="For the first N optimizer steps the heads' loss does not reach the adapters (Medusa-2's "
               "warm-up: fresh heads settle before they pull on the target).", at_least=0)


@dataclass
class HeadsEvalConfig(RecipeEvalConfig):
    tree_depth: int | None = setting(
        None, doc="Depth of the candidate tree (drafttrain's default Medusa tree cut to this depth, the same "
                  "tree `drafttrain eval --heads` uses with --num-draft-tokens set to it); default: num_heads.")
    tree_nodes: int = setting(
        22, doc="After training, the heads' top-k accuracy is measured on the held-out prompts and the tree with "
                "this many nodes (besides the root) and the largest expected acceptance is stored with them; "
                "`drafttrain eval --tree auto` (the default) uses it. 0: no calibration, keep the default tree.",
        at_least=0)
    calibration_topk: int = setting(8, doc="Top-k choices per head considered for the calibrated tree.", at_least=1)


@dataclass
class HeadsConfig(RecipeConfig):
    responses_only = "heads train"
    output_dir: str = run_directory("final/ (heads in vLLM's format; Medusa-2 also final/target/)")
    eval: HeadsEvalConfig = held_out_eval(HeadsEvalConfig)
    heads: HeadsArchConfig = setting(default_factory=HeadsArchConfig, doc="The heads' shape and what trains.")
    loss: HeadsLossConfig = setting(default_factory=HeadsLossConfig, doc="The heads' loss.")
    lora: HeadsLoraConfig = setting(default_factory=HeadsLoraConfig, doc="Medusa-2: LoRA on the target.")

    def validate_own(self) -> None:
        if self.heads.num_layers == 0 and not self.heads.train_lm_heads:
            raise UserError("with heads.num_layers=0 and heads.train_lm_heads=false nothing would train; "
                            "set heads.num_layers >= 1 or heads.train_lm_heads=true")
        self._validate_lora()
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
        if importlib.util.find_spec("peft") is None:
            raise UserError("lora.enabled=true (Medusa-2) needs the peft package; pip install 'drafttrain[heads]'")
        if not lora.target_modules:
            raise UserError("lora.target_modules is empty; name the target's linear layers, e.g. [q_proj, v_proj]")

    @property
    def kind(self) -> str:
        return "medusa-2" if self.lora.enabled else "medusa-1"


# ----------------------------------------------------------------------------- the recipe


class HeadsRecipe(Recipe[HeadsConfig]):
    script = "recipes/train_heads.py"
    drafter_name = "heads"

    def load_models(self) -> None:
        cfg = self.config
        self.load_frozen_target()
        check_last_hidden_state(self.target)
        if cfg.lora.enabled:
            check_lora_modules(self.target, cfg.lora.target_modules)
        self.heads = fresh_heads(self.target, cfg.heads).to(self.device)
        self.tree_depth = cfg.eval.tree_depth or cfg.heads.num_heads

    def describe(self) -> str:
        return f"training {self.config.kind} heads"

    def build_trainable(self) -> nn.Module:
        cfg = self.config
        loss = dict(kind=cfg.loss.kind, decay=cfg.loss.decay, chunk_size=cfg.loss.chunk_size)
        if cfg.lora.enabled:  # after the data: the target answered the prompts as it was
            return JointObjective(add_lora(self.target, cfg.lora), self.heads, lm_loss=cfg.lora.lm_loss,
                                  lm_loss_weight=cfg.lora.lm_loss_weight, **loss)
        return HeadsObjective(self.heads, **loss)

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        cfg = self.config
        if cfg.lora.enabled:
            return model(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch["labels"],
                         heads_reach_target=batch["step"] >= cfg.lora.heads_warmup_steps,
                         position_ids=batch["position_ids"])
        # Medusa-1: the frozen target runs here; nothing before the first trained position counts,
        # so its LM head skips it.
        start = response_window(batch["loss_mask"])
        keep = batch["input_ids"].shape[1] - start if cfg.loss.kind == "kl" else 1
        with torch.no_grad():
            o = self.target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            position_ids=batch["position_ids"], output_hidden_states=True, use_cache=False,
                            logits_to_keep=keep)
        teacher = o.logits if cfg.loss.kind == "kl" else None
        return model(o.hidden_states[-1][:, start:], batch["loss_mask"][:, start:], batch["labels"][:, start:],
                     teacher)

    def evaluate(self, model) -> dict:
        return heads_acceptance(self.verifier(model), model.heads, self.prompts, tree_depth=self.tree_depth,
                                max_new_tokens=self.config.eval.max_new_tokens, eos_token_ids=set(self.eos_ids))

    def verifier(self, model) -> nn.Module:
        """Medusa-2 verifies with the adapted target (adapters on), Medusa-1 with the target itself."""
        return model.target if self.config.lora.enabled else self.target

    def final_evaluations(self, result) -> dict:
        """The heads as a chain (what vLLM serves, and what chain plans read): held-out acceptance and
        the plans it implies; with eval.tree_nodes, the tree calibrated on the trained heads and its
        held-out tau."""
        cfg = self.config
        module = result.model.eval()
        k = cfg.heads.num_heads
        chain = heads_acceptance(self.verifier(module), module.heads, self.prompts, tree_depth=k,
                                 max_new_tokens=cfg.eval.max_new_tokens, eos_token_ids=set(self.eos_ids),
                                 tree=chain_tree(k))
        plans = export_plans(self.verifier(module), chain["per_position_acceptance"], self.prompts[0].ids,
                             where=str(self.out / "final"), heads=module.heads)
        out = {"chain": chain, "plans": plans}
        if not cfg.eval.tree_nodes:
            return out
        calibrated = self.calibrate_tree(result.model)
        self.accelerator.print(f"calibrated tree: {cfg.eval.tree_nodes} nodes, held-out tau "
                               f"{calibrated['tau']:.3f} (default tree {result.best_metrics['tau']:.3f})")
        return {**out, "calibrated": calibrated}

    def export(self, result, initial: dict, final: dict, extra: dict) -> None:
        cfg, final_dir = self.config, self.out / "final"
        k = cfg.heads.num_heads
        chain, calibrated = extra["chain"], extra.get("calibrated")
        record = self.card_record(chain, extra["plans"])
        rows = [table_row("fresh heads (before training)", initial),
                table_row(f"trained (step {result.best_step})", final)]
        if calibrated:
            rows.append(table_row(f"trained, calibrated tree ({len(calibrated['tree'])} nodes)", calibrated))

        def write(served: list[dict]) -> None:
            export_final(result.model, cfg, self.tokenizer, final_dir, result.step, result.best_step, rows + served,
                         len(self.prompts), calibrated=calibrated, plans=planned_k(extra["plans"]), record=record)

        # vLLM serves the heads as one top-1 chain, not as our tree: the card shows that chain as
        # drafttrain decodes it beside vLLM's figure, the setting a user deploys.
        verifier = str(final_dir / "target") if cfg.lora.enabled else None
        self.export_with_served_row(write, "medusa", k, verifier=verifier,
                                    beside=(table_row(f"trained, chain of {k} (what vLLM serves)", chain),))

    def calibrate_tree(self, module: nn.Module) -> dict:
        """The trained heads' top-k accuracy on the held-out prompts, the tree it implies, and that
        tree's held-out acceptance: {"topk_accuracy", "tree", **acceptance metrics}."""
        cfg = self.config
        module.eval()  # LoRA dropout off, as in every evaluation
        verifier = self.verifier(module)
        accuracy = head_topk_accuracy(verifier, module.heads, [p.ids for p in self.prompts],
                                      topk=cfg.eval.calibration_topk, max_new_tokens=cfg.eval.max_new_tokens,
                                      eos_token_ids=self.eos_ids)
        tree = tree_from_accuracies(accuracy[:self.tree_depth], cfg.eval.tree_nodes)
        metrics = heads_acceptance(verifier, module.heads, self.prompts, tree_depth=self.tree_depth, tree=tree,
                                   max_new_tokens=cfg.eval.max_new_tokens, eos_token_ids=set(self.eos_ids))
        return {**metrics, "topk_accuracy": accuracy, "tree": [list(p) for p in tree]}

    def summary_fields(self) -> dict:
        return {"kind": self.config.kind}


# ----------------------------------------------------------------------------- the pieces


def check_last_hidden_state(target) -> None:
    """The heads must read the state the LM head reads (post-norm). transformers 5.x returns it as
    `hidden_states[-1]`; a model that returns the pre-norm state would train useless heads."""
    lm_head = target.get_output_embeddings()
    vocab = output_vocab_size(target)
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
        heads = MedusaHeads.from_target(target, num_heads=cfg.num_heads, num_layers=cfg.num_layers,
                                        shared_lm_head=cfg.share_lm_head)
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


def heads_acceptance(target, heads: MedusaHeads, prompts: list[EncodedPrompt], *, tree_depth: int,
                     max_new_tokens: int, eos_token_ids: set[int], tree: list | None = None) -> dict:
    """Greedy Medusa tree decoding of `prompts`: tau, acceptance and per-head acceptance (with
    `tree`, or the default tree cut to `tree_depth`)."""
    settings = DecodeSettings(num_draft_tokens=tree_depth, eos_token_ids=frozenset(eos_token_ids))
    return held_out_acceptance(target, Drafter("medusa", heads, {"tree": tree}), prompts, settings, max_new_tokens)


def main(argv: list[str] | None = None) -> int:
    return recipe_main(HeadsRecipe, argv)


if __name__ == "__main__":
    exit_with(main())
