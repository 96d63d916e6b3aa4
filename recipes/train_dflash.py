"""Train a DFlash block draft for a target (SPEC §9): a block of drafts from one forward on its features.

    accelerate launch recipes/train_dflash.py --config recipes/configs/NAME.yaml [--overwrite] [key=value ...]
    python recipes/train_dflash.py --config recipes/configs/NAME.yaml [key=value ...]

`--help` lists every config key. Bad input prints one `error:` line and exits with status 2.

The story of the run (the shared steps are `drafttrain.training.recipe.Recipe.run`):

1. Load the target, frozen. The draft is `draft.layers` decoder layers shaped like the target's, whose
   context keys and values come from the target's hidden states at `draft.target_layer_ids`
   (`drafttrain.kinds.dflash.model`).
2. The target answers the training prompts itself (cached, as for every recipe).
3. The draft vocabulary: the whole target vocabulary, or its `draft.vocab_size` most used tokens where
   it is large (Gemma-3's 262k), with the d2t / t2d maps.
4. Train: every batch runs the frozen target once (no grad) for its features; `loss.anchors` anchors
   per answer each start a block of `draft.block_size` (the anchor's token, then masks), all blocks in
   one draft forward; each mask slot learns the target's token there, weighted less the later the slot
   (`drafttrain.kinds.dflash.loss`).
5. Measure what matters: greedy speculative decoding of held-out prompts with drafttrain's own decoder,
   K = `eval.num_draft_tokens` drafts a step (at most block_size - 1). Its tau picks the exported weights.
6. Export the best draft to `final/` in vLLM's `DFlashDraftModel` layout (SPEC §9), with its acceptance
   table and the plans its acceptance implies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from drafttrain.config import setting
from drafttrain.data import DataConfig
from drafttrain.data.collate import TrainingCollator
from drafttrain.decoding import NUM_DRAFT_TOKENS, DecodeSettings
from drafttrain.errors import UserError
from drafttrain.evaluation.plan import export_plans
from drafttrain.features import TargetFeatures
from drafttrain.kinds.dflash.export import save_dflash
from drafttrain.kinds.dflash.loss import batch_seed, dflash_loss, sample_anchors, slot_targets, slot_weights
from drafttrain.kinds.dflash.model import (MAX_BLOCK, MIN_BLOCK, DFlashDraft, check_target_layer_ids,
                                           default_target_layer_ids)
from drafttrain.kinds.layers import check_shaped_like
from drafttrain.kinds.vocab import build_draft_vocab
from drafttrain.tokens import mask_token_id
from drafttrain.kinds.registry import trained_drafter
from drafttrain.models import DTYPES
from drafttrain.tokens import output_vocab_size
from drafttrain.training.acceptance import held_out_acceptance, table_row
from drafttrain.training.frozen import gathered
from drafttrain.training.recipe import (Recipe, RecipeConfig, RecipeEvalConfig, exit_with, held_out_eval,
                                         recipe_main, run_directory, training_data)

@dataclass
class DFlashArchConfig:
    layers: int = setting(1, doc="The draft's decoder layers (DFlash's own drafts have 1 to 8).", at_least=1)
    block_size: int = setting(
        8, doc=f"Tokens in a block: the last accepted token and block_size - 1 mask slots, so at most "
               f"block_size - 1 drafts a step. In [{MIN_BLOCK}, {MAX_BLOCK}].", at_least=MIN_BLOCK, at_most=MAX_BLOCK)
    target_layer_ids: list[int] | None = setting(
        None, doc="The target layers whose outputs the draft reads (DFlash's numbering: layer i's output). "
                  "null: 3 layers evenly spaced from 1 to L-3.")
    vocab_size: int | None = setting(
        None, doc="Draft vocabulary: null for the target's whole vocabulary, or the N tokens the target uses most "
                  "in its training answers (EOS always), for a large vocabulary (Gemma-3's 262k).", at_least=2)
    mask_token: int | str = setting(
        "auto", doc="The token id vLLM feeds the mask slots as (its embedding is replaced by the draft's own mask "
                    "embedding): auto = the tokenizer's last spare added token, else an id or token.")


@dataclass
class DFlashLossConfig:
    anchors: int = setting(16, doc="Blocks drawn per answer and batch: each a random position of the answer.",
                           at_least=1)
    decay_length: float | None = setting(
        None, doc="Slot j's loss weight is exp(-(j-1)/decay_length): later drafts count only when every earlier "
                  "one is accepted. null: block_size / 2.", above=0)


@dataclass
class DFlashFeaturesConfig:
    keep_in_memory: bool = setting(
        False, doc="Compute the target's features of each training example once and keep them in RAM for its "
                   "later epochs (as train_eagle3.py's): for small data sets trained several epochs on a CPU.")


@dataclass
class DFlashEvalConfig(RecipeEvalConfig):
    num_draft_tokens: int = setting(
        NUM_DRAFT_TOKENS, doc="K: drafts a step when held-out acceptance is measured (at most block_size - 1).",
        at_least=1)


@dataclass
class DFlashRecipeConfig(RecipeConfig):
    responses_only = "a DFlash draft trains"
    output_dir: str = run_directory("final/ (the draft in vLLM's DFlashDraftModel layout)")
    data: DataConfig = training_data("The draft vocabulary, when reduced, is counted on these answers.")
    eval: DFlashEvalConfig = held_out_eval(DFlashEvalConfig)
    draft: DFlashArchConfig = setting(default_factory=DFlashArchConfig, doc="The draft's shape.")
    loss: DFlashLossConfig = setting(default_factory=DFlashLossConfig, doc="The block loss.")
    features: DFlashFeaturesConfig = setting(
        default_factory=DFlashFeaturesConfig, doc="Where each step's target features come from.")

    def validate_own(self) -> None:
        if self.eval.num_draft_tokens > self.draft.block_size - 1:
            raise UserError(f"eval.num_draft_tokens {self.eval.num_draft_tokens} exceeds draft.block_size - 1 = "
                            f"{self.draft.block_size - 1}: a block drafts at most that many; lower it or raise "
                            "draft.block_size")


class DFlashRecipe(Recipe[DFlashRecipeConfig]):
    script = "recipes/train_dflash.py"
    drafter_name = "DFlash draft"

    def load_models(self) -> None:
        cfg = self.config
        self.load_frozen_target(shard=False)
        check_shaped_like(self.target.config, "the DFlash draft")
        layers = self.target.config.num_hidden_layers
        ids = cfg.draft.target_layer_ids
        self.target_layer_ids = check_target_layer_ids(ids if ids is not None else default_target_layer_ids(layers),
                                                       layers)
        if cfg.draft.vocab_size and cfg.draft.vocab_size > output_vocab_size(self.target):
            raise UserError(f"draft.vocab_size {cfg.draft.vocab_size} exceeds the target's vocabulary of "
                            f"{output_vocab_size(self.target)}; lower it or set it to null")
        self.mask_id = mask_token_id(self.tokenizer, cfg.draft.mask_token)

    def describe(self) -> str:
        d = self.config.draft
        vocab = f"the {d.vocab_size} tokens the target uses most" if d.vocab_size else "the target's vocabulary"
        return (f"DFlash draft of {d.layers} layer(s), blocks of {d.block_size}, over {vocab}, reading the target's "
                f"layers {list(self.target_layer_ids)}")

    def build_trainable(self) -> DFlashDraft:
        """After the data: a reduced draft vocabulary is counted on the target's answers."""
        cfg = self.config
        vocab_size = self.target.config.vocab_size
        answers = [row["response_ids"] for row in self.data.train]
        vocab = build_draft_vocab(answers, vocab_size, cfg.draft.vocab_size or vocab_size, always_include=self.eos_ids)
        target = self.target
        with gathered(target, target.get_input_embeddings(), target.get_output_embeddings(), target.model.norm):
            draft = DFlashDraft.from_target(target, vocab, layers=cfg.draft.layers, block_size=cfg.draft.block_size,
                                            target_layer_ids=self.target_layer_ids, mask_token_id=self.mask_id,
                                            dtype=torch.float32, seed=cfg.train.seed, device=self.device)
        self.embedding = target.get_input_embeddings()
        draft.requires_grad_(True)
        draft.lm_head.requires_grad_(False)  # the target's rows, frozen
        self.weights = slot_weights(cfg.draft.block_size, cfg.loss.decay_length).to(self.device)
        self.features = TargetFeatures(self.target, draft.config.hidden_layers, need_final=False,
                                       keep_in_memory=cfg.features.keep_in_memory)
        return draft.train()

    def prepare_data(self):
        data, prompts = super().prepare_data()
        if self.config.features.keep_in_memory:  # the feature memo's key
            data.train = data.train.add_column("example_index", list(range(len(data.train))))
        return data, prompts

    def make_collator(self):
        return TrainingCollator(self.config.data.max_seq_len, self.pad_id, align_prompts=True)

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        cfg = self.config
        draft = self.accelerator.unwrap_model(model)
        features, _ = self.features(batch)  # the frozen target, no grad
        anchors, real = sample_anchors(batch["loss_mask"], cfg.loss.anchors,
                                       batch_seed(cfg.train.seed, batch["input_ids"]))
        logits = model(features.to(draft.fc.weight.dtype), batch["input_ids"], anchors,
                       position_ids=batch["position_ids"], attention_mask=batch["attention_mask"])
        tokens, trained = slot_targets(batch["input_ids"], batch["loss_mask"], anchors, real, cfg.draft.block_size)
        out = dflash_loss(logits, tokens, trained, draft.t2d, self.weights)
        logs = {f"acc_{j + 1}": acc for j, acc in enumerate(out.slot_accuracy.nan_to_num(0.0).tolist())}
        return out.loss, {**logs, "coverage": out.coverage, "tokens": trained.sum()}

    def evaluate(self, model) -> dict:
        """Held-out greedy acceptance of the draft, K drafts a step."""
        e = self.config.eval
        model.attach_embeddings(self.embedding)
        settings = DecodeSettings(num_draft_tokens=e.num_draft_tokens, eos_token_ids=frozenset(self.eos_ids))
        return held_out_acceptance(self.target, trained_drafter(dflash=model), self.prompts, settings,
                                   e.max_new_tokens)

    def final_evaluations(self, result) -> dict:
        """The plans the chosen draft's acceptance implies."""
        plans = export_plans(self.target, result.best_metrics["per_position_acceptance"], self.prompts[0].ids,
                             where=str(self.out / "final"), dflash=result.model)
        return {"plans": plans}

    def export(self, result, initial: dict, final: dict, extra: dict) -> None:
        """final/: the best draft, with its held-out acceptance."""
        cfg = self.config
        model = result.model
        rows = [table_row("initial (before training)", initial), table_row(f"final (step {result.best_step})", final)]
        plans = extra["plans"]
        record = self.card_record(final, plans)
        vocab = (f"{model.config.draft_vocab_size} most frequent target tokens" if cfg.draft.vocab_size else
                 "the target's")

        def write(served: list[dict]) -> None:
            save_dflash(model.to(DTYPES[cfg.export_dtype]), self.out / "final", acceptance_table=rows + served,
                        record=record,
                        base_info={"target": cfg.target, "recipe": f"drafttrain {self.script}",
                                   "block size": cfg.draft.block_size, "draft vocabulary": vocab,
                                   **self.trained_info(result, plans)})

        self.export_with_served_row(write, "dflash", cfg.eval.num_draft_tokens)


def main(argv: list[str] | None = None) -> int:
    return recipe_main(DFlashRecipe, argv)


if __name__ == "__main__":
    exit_with(main())
