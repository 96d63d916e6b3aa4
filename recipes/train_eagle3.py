"""Train an EAGLE-3 draft for a target (SPEC §4): one layer that reads the target's own features.

    accelerate launch recipes/train_eagle3.py --config recipes/configs/NAME.yaml [--overwrite] [key=value ...]
    python recipes/train_eagle3.py --config recipes/configs/NAME.yaml [key=value ...]

`--help` lists every config key. Bad input prints one `error:` line and exits with status 2.

The story of the run (the shared steps are `drafttrain.training.recipe.Recipe.run`):

1. Load the target, frozen. The draft is one decoder layer shaped like the target's, fed with
   the target's hidden states from a low, a middle and a high layer (`fc` fuses them) plus the
   embedding of the next token (Li et al. 2025).
2. The target answers the training prompts itself (cached, as for distillation).
3. The draft vocabulary: the `draft.vocab_size` tokens the target uses most in those answers
   (the EOS ids always), with the `d2t` / `t2d` maps to and from the target's vocabulary. A
   smaller LM head makes every drafting step cheaper; tokens outside it are never proposed.
4. Train with training-time test: every batch runs the frozen target once (no grad) for its
   features, then the draft is unrolled `loss.ttt_steps` steps on its own outputs, each step
   learning forward KL against the target's distribution restricted to the draft vocabulary,
   weighted `loss.decay`^step. The target's features are computed here, online: no hidden-state
   dumps on disk.
5. Measure what matters: greedy speculative decoding of held-out prompts with drafttrain's own
   decoder (`eval.tree`: a chain of K, or EAGLE-2's dynamic tree). Its tau picks the exported weights.
6. Export the best draft to `final/` in the layout SGLang and vLLM load (SPEC §3), with its
   acceptance table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from drafttrain.config import setting
from drafttrain.data import DataConfig
from drafttrain.data.collate import TrainingCollator
from drafttrain.decoding import NUM_DRAFT_TOKENS
from drafttrain.decoding import DecodeSettings
from drafttrain.kinds.base import Drafter
from drafttrain.kinds.eagle3.export import save_eagle3
from drafttrain.features import TargetFeatures
from drafttrain.kinds.eagle3.loss import (eagle3_loss, first_trained_index, next_tokens, teacher_logits_from_hidden, teacher_logits_from_topk)
from drafttrain.kinds.eagle3.model import Eagle3Draft, check_aux_layer_ids
from drafttrain.kinds.layers import check_shaped_like
from drafttrain.kinds.vocab import build_draft_vocab
from drafttrain.errors import UserError
from drafttrain.evaluation.plan import export_plans
from drafttrain.models import DTYPES
from drafttrain.tokens import output_vocab_size
from drafttrain.training.acceptance import held_out_acceptance, table_row
from drafttrain.training.distributed import is_sharded
from drafttrain.training.frozen import gathered
from drafttrain.training.recipe import (Recipe, RecipeConfig, RecipeEvalConfig, exit_with, held_out_eval,
                                         recipe_main, run_directory, training_data)

# ----------------------------------------------------------------------------- config


@dataclass
class Eagle3ArchConfig:
    vocab_size: int = setting(
        16000, doc="Draft vocabulary: the N tokens the target uses most in its training answers (EOS always). "
                   "Larger covers more of what the target says; smaller makes each drafting step cheaper.",
        at_least=2)
    aux_layer_ids: list[int] | None = setting(
        None, doc="The target's hidden states the draft reads, as transformers' output_hidden_states indices "
                  "(i = the output of layer i-1): a low, a middle and a high layer. null: (2, L//2, L-3), the "
                  "default of vLLM and SGLang, so the exported draft needs no layer setting there.")
    freeze_lm_head: bool = setting(
        False, doc="Keep the draft's LM head at its start (the target's LM head rows of the draft vocabulary).")


@dataclass
class Eagle3LossConfig:
    ttt_steps: int = setting(
        3, doc="Training-time test: steps the draft is unrolled on its own outputs per position (step 0 reads "
               "the target's features; step j its own step j-1 output). At most data.max_seq_len: each step "
               "costs a forward of the whole sequence, and past it no position is left to train.", at_least=1)
    decay: float = setting(0.8, doc="Step j's loss is weighted decay^j (normalised): later drafts count less.",
                          above=0, at_most=1)
    teacher: Literal["auto", "hidden", "topk"] = setting(
        "auto", doc="The target's distribution in the loss: hidden = its final hidden state times its LM head's "
                    "rows of the draft vocabulary (exact); topk = the top-k log-probs stored with the data "
                    "(data.store_topk, no LM head at all); auto = topk when stored, else hidden.")


@dataclass
class Eagle3FeaturesConfig:
    keep_in_memory: bool = setting(
        False, doc="Compute the target's features of each training example once (the example alone, so they do "
                   "not depend on its batch and a resume stays exact) and keep them in RAM for its later epochs: "
                   "for small data sets trained several epochs, where the target's forward dominates a step (a "
                   "CPU). Costs examples x tokens x 3*H values (4*H with the hidden teacher) of the target's "
                   "dtype. false: one target forward per batch.")
    shard_target: bool = setting(
        False, doc="Under an FSDP or DeepSpeed ZeRO-3 launch, shard the frozen target across the ranks too, so each "
                   "GPU holds 1/N of it (loaded whole into CPU memory first). Every rank then runs the same target "
                   "forwards in lockstep: it generates the training answers and decodes the held-out prompts with the "
                   "others (the eager engine). For targets too large to copy onto every GPU.")


@dataclass
class Eagle3EvalConfig(RecipeEvalConfig):
    num_draft_tokens: int = setting(
        NUM_DRAFT_TOKENS, doc="K: the chain's drafts per step, or the dynamic tree's depth.", at_least=1)
    tree: Literal["chain", "dynamic"] = setting(
        "chain", doc="How held-out acceptance is measured (and the best weights picked): chain of K, or "
                     "EAGLE-2's dynamic tree (tree_nodes, tree_topk).")
    tree_nodes: int = setting(32, doc="Dynamic tree: nodes verified per step, the pending token included.",
                              at_least=2)
    tree_topk: int = setting(4, doc="Dynamic tree: nodes expanded per depth, children drafted per node.", at_least=1)


@dataclass
class Eagle3RecipeConfig(RecipeConfig):
    responses_only = "an EAGLE-3 draft trains"
    output_dir: str = run_directory("final/ (the draft in SGLang's and vLLM's EAGLE-3 layout)")
    data: DataConfig = training_data(
        "The draft vocabulary is counted on these answers. With data.store_topk > 0, loss.teacher auto reads the "
        "stored top-k instead of the target's LM head.")
    eval: Eagle3EvalConfig = held_out_eval(Eagle3EvalConfig)
    draft: Eagle3ArchConfig = setting(default_factory=Eagle3ArchConfig, doc="The draft's shape.")
    loss: Eagle3LossConfig = setting(default_factory=Eagle3LossConfig, doc="The training-time-test loss.")
    features: Eagle3FeaturesConfig = setting(
        default_factory=Eagle3FeaturesConfig, doc="Where each step's target features come from.")

    def validate_own(self) -> None:
        if self.loss.ttt_steps > self.data.max_seq_len:
            raise UserError(f"loss.ttt_steps {self.loss.ttt_steps} exceeds data.max_seq_len {self.data.max_seq_len}: "
                            "each step unrolls the draft over the whole sequence, and past it no position is left "
                            "to train; use a few steps (EAGLE-3 trains 3 to 7)")
        if self.loss.teacher == "topk" and not self.data.store_topk:
            raise UserError("loss.teacher=topk reads the target's stored top-k, but data.store_topk is 0; set "
                            "data.store_topk (e.g. 32) or loss.teacher=hidden")
        if self.features.shard_target and self.features.keep_in_memory:
            raise UserError("features.keep_in_memory runs the target once per example, at different times on each "
                            "rank, which a sharded target cannot do; set features.keep_in_memory=false")


# ----------------------------------------------------------------------------- the recipe


class Eagle3Recipe(Recipe[Eagle3RecipeConfig]):
    script = "recipes/train_eagle3.py"
    drafter_name = "EAGLE-3 draft"

    def load_models(self) -> None:
        cfg = self.config
        if cfg.features.shard_target and not is_sharded(self.accelerator):
            raise UserError("features.shard_target splits the target across the ranks of an FSDP or ZeRO-3 launch; "
                            "launch with recipes/accelerate/fsdp2.yaml or deepspeed_zero3.yaml, or set "
                            "features.shard_target=false")
        self.load_frozen_target(shard=cfg.features.shard_target)
        check_shaped_like(self.target.config, "the EAGLE-3 draft")
        layers = self.target.config.num_hidden_layers
        # Checked now, before the target answers anything: the default too (a small target has none).
        checked = check_aux_layer_ids(cfg.draft.aux_layer_ids, layers)
        self.aux_layer_ids = checked if cfg.draft.aux_layer_ids is not None else None
        if cfg.draft.vocab_size > output_vocab_size(self.target):
            raise UserError(f"draft.vocab_size {cfg.draft.vocab_size} exceeds the target's vocabulary of "
                            f"{output_vocab_size(self.target)}; lower it")

    def describe(self) -> str:
        ids = self.trainable.config.aux_layer_ids if hasattr(self, "trainable") else self.aux_layer_ids
        return (f"EAGLE-3 draft over the {self.config.draft.vocab_size} tokens the target uses most, reading its "
                f"hidden states {list(ids) if ids else 'at (2, L//2, L-3)'}")

    def prepare_data(self):
        data, prompts = super().prepare_data()
        if self.config.features.keep_in_memory:  # the feature memo's key
            data.train = data.train.add_column("example_index", list(range(len(data.train))))
        return data, prompts

    def make_collator(self):
        return TrainingCollator(self.config.data.max_seq_len, self.pad_id, align_prompts=True)

    def build_trainable(self) -> Eagle3Draft:
        """After the data: the draft vocabulary is counted on the target's answers."""
        cfg = self.config
        answers = [row["response_ids"] for row in self.data.train]
        vocab = build_draft_vocab(answers, self.target.config.vocab_size, cfg.draft.vocab_size,
                                  always_include=self.eos_ids)
        target = self.target
        embedding, head = target.get_input_embeddings(), target.get_output_embeddings()
        with gathered(target, embedding, head, target.model.norm):  # full weights, even when sharded
            draft = Eagle3Draft.from_target(target, vocab, aux_layer_ids=self.aux_layer_ids, dtype=torch.float32,
                                            seed=cfg.train.seed, device=self.device)
            # The teacher's readout: the target's LM head rows of the draft vocabulary, fixed.
            self.teacher_rows = head.weight.detach().index_select(0, draft.draft_target_ids.to(head.weight.device))
            self.teacher_rows = self.teacher_rows.to(self.device, copy=True)
            if self.target_sharded:  # the draft embeds tokens outside the target's forward: a plain copy
                embedding = nn.Embedding.from_pretrained(embedding.weight.detach().to(self.device, copy=True))
        self.embedding = embedding
        draft.attach_embeddings(embedding)
        draft.requires_grad_(True)
        if cfg.draft.freeze_lm_head:
            draft.lm_head.requires_grad_(False)
        self.teacher_kind = cfg.loss.teacher if cfg.loss.teacher != "auto" else (
            "topk" if cfg.data.store_topk else "hidden")
        self.features = TargetFeatures(self.target, draft.config.aux_layer_ids, need_final=self.teacher_kind == "hidden",
                                       keep_in_memory=cfg.features.keep_in_memory)
        return draft.train()

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        cfg = self.config
        draft = self.accelerator.unwrap_model(model)
        steps = cfg.loss.ttt_steps
        start = first_trained_index(batch["loss_mask"], steps)  # the draft skips the prompt's head
        features, final_hidden = self.features(batch)  # the frozen target, no grad
        with torch.no_grad():
            if self.teacher_kind == "topk":
                teacher = teacher_logits_from_topk(batch["topk_ids"][:, start:], batch["topk_logprobs"][:, start:],
                                                   draft.draft_target_ids, draft.config.vocab_size)
            else:
                teacher = teacher_logits_from_hidden(final_hidden[:, start:], self.teacher_rows)
        logits = model(features.to(draft.fc.weight.dtype), batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], num_steps=steps, logits_from=start)
        out = eagle3_loss(logits, teacher, batch["loss_mask"][:, start:], batch["attention_mask"][:, start:],
                          next_tokens(batch["input_ids"], start), draft.d2t, draft.t2d, decay=cfg.loss.decay)
        logs = {f"acc_{j}": acc for j, acc in enumerate(out.step_accuracy.nan_to_num(0.0).tolist())}
        return out.loss, {**logs, "coverage": out.coverage, "tokens": batch["loss_mask"].sum()}

    def acceptance(self, draft: Eagle3Draft, tree: str) -> dict:
        """Held-out greedy acceptance of `draft` as a chain or a dynamic tree."""
        e = self.config.eval
        draft.attach_embeddings(self.embedding)
        settings = DecodeSettings(num_draft_tokens=e.num_draft_tokens, eos_token_ids=frozenset(self.eos_ids),
                                  tree=tree, tree_nodes=e.tree_nodes, tree_topk=e.tree_topk)
        return held_out_acceptance(self.target, Drafter("eagle3", draft), self.prompts, settings, e.max_new_tokens,
                                   extra={"tree": tree})

    def evaluate(self, model) -> dict:
        return self.acceptance(model, self.config.eval.tree)

    def final_evaluations(self, result) -> dict:
        """The chosen draft's held-out acceptance the other way (as a dynamic tree if it was picked as
        a chain, and the other way round), and the plans its chain acceptance implies (measured on
        every rank when the target is sharded: its forwards need them all)."""
        cfg = self.config
        other = "dynamic" if cfg.eval.tree == "chain" else "chain"
        measured = self.acceptance(result.model, other)
        chain = result.best_metrics if cfg.eval.tree == "chain" else measured
        plans = export_plans(self.target, chain["per_position_acceptance"], self.prompts[0].ids,
                             where=str(self.out / "final"), eagle3=result.model)
        return {f"final_{other}": measured, "plans": plans}

    def export(self, result, initial: dict, final: dict, extra: dict) -> None:
        """final/: the best draft, with its held-out acceptance as a chain and as a dynamic tree."""
        cfg = self.config
        model = result.model
        other = "dynamic" if cfg.eval.tree == "chain" else "chain"
        other_metrics = extra[f"final_{other}"]

        def how(tree: str) -> str:
            e = cfg.eval
            return f"dynamic tree of {e.tree_nodes} nodes, top-{e.tree_topk}" if tree == "dynamic" else "chain"

        rows = [table_row(f"initial (before training), {how(cfg.eval.tree)}", initial),
                table_row(f"final (step {result.best_step}), {how(cfg.eval.tree)}", final),
                table_row(f"final (step {result.best_step}), {how(other)}", other_metrics)]
        chain = final if cfg.eval.tree == "chain" else other_metrics
        plans = extra["plans"]
        record = self.card_record(chain, plans)

        def write(served: list[dict]) -> None:
            save_eagle3(model.to(DTYPES[cfg.export_dtype]), self.out / "final", acceptance_table=rows + served,
                        record=record,
                        base_info={"target": cfg.target, "recipe": f"drafttrain {self.script}",
                                   "draft vocabulary": f"{model.config.draft_vocab_size} most frequent target tokens",
                                   "training-time-test steps": cfg.loss.ttt_steps, "teacher": self.teacher_kind,
                                   **self.trained_info(result, plans)})

        self.export_with_served_row(write, "eagle3", cfg.eval.num_draft_tokens)  # vLLM serves it as a chain


def main(argv: list[str] | None = None) -> int:
    return recipe_main(Eagle3Recipe, argv)


if __name__ == "__main__":
    exit_with(main())
