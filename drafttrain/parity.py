"""drafttrain's side of the side-by-side with vLLM's own drafter trainer, `speculators` (issue 41;
`scripts/parity.sh` runs it).

The other trainer gets exactly drafttrain's data: the same prompts, the same target answers (read from
drafttrain's answer cache through the same data pipeline and the same truncation to
`data.max_seq_len`), and the target's hidden states that vLLM's extraction would have written for
them, computed here with transformers. What this module writes, in speculators 0.9's own layout
(`speculators/train/data.py`, `hs_connectors.FileTransfer`):

- a `datasets` dataset (`save_to_disk`, torch format) with `input_ids`, `loss_mask` (1 on the answer's
  tokens, 0 on the prompt's, as speculators' `prepare_data` marks an assistant turn) and `seq_len`;
- `hidden_states/hs_{i}.safetensors`: `token_ids` [n] and `hidden_states` [n, len(layers) + 1, H]: the
  residual stream ENTERING each of the draft's target layers (transformers' `hidden_states[i]`, which
  is vLLM's `aux_hidden_state_layer_ids` numbering), then the last layer's output BEFORE the final
  norm (speculators applies the target's norm and LM head to it for its teacher);
- `d2t-{N}.npy` / `t2d-{N}.npy`: drafttrain's own draft vocabulary (`kinds.vocab.build_draft_vocab`, the
  same convention), so both drafts propose from the same tokens;
- one validation row after the training rows (a copy of the first): speculators holds out the last
  `1 - train_data_ratio` of the rows, and `train_data_ratio` is chosen so that it holds out that copy
  only and trains on every row drafttrain trains on.

`speculators_argv` maps a drafttrain recipe config onto speculators' `train` flags and lists what
cannot be matched; `convert_eagle3_export` rewrites a speculators EAGLE-3 checkpoint into the layout
drafttrain's decoder (and vLLM) loads, so one judge measures both exports.

    python -m drafttrain.parity data --kind eagle3 --config recipes/configs/X.yaml [key=value ...] --out DIR
    python -m drafttrain.parity argv --kind eagle3 --config ... --data DIR --save DIR   (one flag a line)
    python -m drafttrain.parity export --kind eagle3 --checkpoint DIR --target T --out DIR
    python -m drafttrain.parity report --dir RUN_DIR                                  (markdown)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .data.collate import pack_example
from .errors import UserError

SPECULATORS_VERSION = "0.9.0"
DATA_META = "parity_data.json"
KINDS = ("eagle3", "dflash")


# ----------------------------------------------------------------------------- rows


def speculators_example(prompt_ids: Sequence[int], response_ids: Sequence[int], max_seq_len: int,
                        kind: str = "eagle3") -> tuple[list[int], list[int]] | None:
    """One row in speculators' layout: (input_ids, loss_mask). The sequence is cut exactly as drafttrain's
    collator cuts it (`pack_example`: the answer first, then the prompt's head), so both trainers see the
    same tokens; None where no answer token is left.

    The loss mask is chosen so that speculators trains the same drafts drafttrain does:
    - eagle3: speculators' `shift_batch` trains, where loss_mask[p], the draft made at p of token p + 1,
      which is drafttrain's own mask (positions len(prompt) - 1 .. n - 2: every answer token is drafted,
      the first one from the prompt's last token);
    - dflash: speculators anchors blocks where loss_mask[p] and trains slot p + j where loss_mask[p + j];
      drafttrain anchors from the prompt's last token and trains every answer token, so the mask is 1 on
      the prompt's last token and the whole answer.
    speculators' own `prepare_data` marks the answer's tokens only (one position fewer: the draft of
    the answer's first token is never trained, and EAGLE-3 also trains a draft after the answer's end)."""
    packed = pack_example(prompt_ids, response_ids, max_seq_len)
    ids, trained = packed["input_ids"], packed["loss_mask"]
    if True not in trained:
        return None
    if kind == "eagle3":
        return list(ids), [int(t) for t in trained]
    if kind == "dflash":
        last_prompt = trained.index(True)
        return list(ids), [0] * last_prompt + [1] * (len(ids) - last_prompt)
    raise ValueError(f"unknown kind {kind!r}")


def validation_ratio(train_rows: int) -> float:
    """speculators' `train_data_ratio` that keeps the first `train_rows` rows of `train_rows + 1` for
    training (its split is `int(len * ratio)`)."""
    ratio = (train_rows + 0.5) / (train_rows + 1)
    assert int((train_rows + 1) * ratio) == train_rows
    return ratio


# ----------------------------------------------------------------------------- hidden states


def final_norm(target) -> torch.nn.Module:
    base = getattr(target, "model", None)
    norm = getattr(base, "norm", None)
    if norm is None:
        raise UserError(f"{type(target).__name__} has no model.norm; the parity data needs the last layer's "
                        "output before the final norm")
    return norm


@torch.no_grad()
def target_hidden_states(target, input_ids: Sequence[int], layer_ids: Sequence[int]) -> torch.Tensor:
    """[n, len(layer_ids) + 1, H]: `hidden_states[i]` for i in `layer_ids` (the input of layer i), then
    the last layer's output before the final norm, of one sequence run alone (positions 0 .. n-1)."""
    captured: list[torch.Tensor] = []
    hook = final_norm(target).register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        device = next(target.parameters()).device
        ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=device)[None]
        out = target(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=device)[None],
                     output_hidden_states=True, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    if len(captured) != 1:
        raise RuntimeError(f"the target's final norm ran {len(captured)} times in one forward; expected once")
    layers = [out.hidden_states[i][0] for i in layer_ids] + [captured[0][0]]
    return torch.stack(layers, dim=1)


# ----------------------------------------------------------------------------- the dataset


@dataclass
class DataSummary:
    kind: str
    rows: int                      # training rows (the validation copy not counted)
    tokens: int
    trained_positions: int         # loss_mask ones
    layer_ids: list[int]           # speculators' numbering (= transformers' hidden_states index)
    draft_vocab_size: int | None
    hidden_dtype: str
    dropped: int = 0               # rows with no answer token left after the cut
    train_data_ratio: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def mean_seq_len(self) -> float:
        return self.tokens / max(1, self.rows)


def write_speculators_data(out_dir, rows: Sequence[tuple[Sequence[int], Sequence[int]]], target, *,
                           layer_ids: Sequence[int], max_seq_len: int, kind: str = "eagle3", vocab=None,
                           dtype: torch.dtype = torch.float32, limit: int | None = None,
                           progress: bool = False, extra: dict | None = None) -> DataSummary:
    """Write speculators' training data for `rows` of (prompt_ids, response_ids) to `out_dir` (a new
    or empty directory). `vocab`: a `kinds.vocab.DraftVocab` written as d2t/t2d (None: the full
    vocabulary, no maps). `limit`: the first N rows only (toy runs)."""
    import datasets
    import numpy as np
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} is not empty; remove it or pick another --out")
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    examples, dropped = [], 0
    for prompt, response in rows[:limit] if limit else rows:
        ex = speculators_example(prompt, response, max_seq_len, kind)
        if ex is None:
            dropped += 1
        else:
            examples.append(ex)
    if not examples:
        raise UserError("no training row has an answer token left; nothing to convert")
    examples.append(examples[0])  # the validation row (see the module docstring)
    from tqdm.auto import tqdm

    with tqdm(enumerate(examples), total=len(examples), desc="target hidden states", unit="row",
              disable=not progress) as bar:
        for i, (ids, _mask) in bar:
            hs = target_hidden_states(target, ids, layer_ids).to(dtype).cpu().contiguous()
            save_file({"hidden_states": hs, "token_ids": torch.tensor(ids, dtype=torch.long)},
                      str(hs_dir / f"hs_{i}.safetensors"))
    data = datasets.Dataset.from_dict({
        "input_ids": [ids for ids, _ in examples],
        "loss_mask": [mask for _, mask in examples],
        "seq_len": [len(ids) for ids, _ in examples],
    }, features=datasets.Features({"input_ids": datasets.List(datasets.Value("int64")),
                                   "loss_mask": datasets.List(datasets.Value("int64")),
                                   "seq_len": datasets.Value("int64")}))
    data.set_format("torch")
    data.save_to_disk(str(out))
    if vocab is not None:
        np.save(out / f"d2t-{vocab.size}.npy", vocab.d2t.numpy())
        np.save(out / f"t2d-{vocab.size}.npy", vocab.t2d.numpy())
    train = examples[:-1]
    summary = DataSummary(kind=kind, rows=len(train), tokens=sum(len(i) for i, _ in train),
                          trained_positions=sum(sum(m) for _, m in train), layer_ids=list(layer_ids),
                          draft_vocab_size=vocab.size if vocab is not None else None,
                          hidden_dtype=str(dtype).removeprefix("torch."), dropped=dropped,
                          train_data_ratio=validation_ratio(len(train)), extra=dict(extra or {}))
    (out / DATA_META).write_text(json.dumps({**summary.__dict__, "mean_seq_len": summary.mean_seq_len},
                                            indent=2) + "\n")
    return summary


def read_data_summary(data_dir) -> DataSummary:
    path = Path(data_dir) / DATA_META
    if not path.is_file():
        raise UserError(f"{data_dir} has no {DATA_META}; write it with `python -m drafttrain.parity data`")
    raw = json.loads(path.read_text())
    raw.pop("mean_seq_len", None)
    return DataSummary(**raw)


# ----------------------------------------------------------------------------- drafttrain's recipe config


def recipe_config(kind: str, config: str, overrides: Sequence[str] = ()):
    """The recipe's config (recipes/train_eagle3.py or train_dflash.py), validated, ${VAR}s expanded."""
    from .config import load_config

    if kind == "eagle3":
        from recipes.train_eagle3 import Eagle3RecipeConfig as cls
    elif kind == "dflash":
        from recipes.train_dflash import DFlashRecipeConfig as cls
    else:
        raise UserError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    cfg = load_config(cls, config, list(overrides))
    cfg.validate()
    return cfg


def speculators_layer_ids(kind: str, cfg, num_layers: int) -> list[int]:
    """The draft's target layers in speculators' (and vLLM's aux) numbering: the input of layer i, which
    is transformers' hidden_states[i]. EAGLE-3's aux_layer_ids already are; DFlash's target_layer_ids
    count the output of layer i, so they are one less."""
    if kind == "eagle3":
        from .kinds.eagle3.model import check_aux_layer_ids, default_aux_layer_ids

        ids = cfg.draft.aux_layer_ids
        return list(check_aux_layer_ids(ids if ids is not None else default_aux_layer_ids(num_layers), num_layers))
    from .kinds.dflash.model import check_target_layer_ids, default_target_layer_ids

    ids = cfg.draft.target_layer_ids
    return [i + 1 for i in check_target_layer_ids(ids if ids is not None else default_target_layer_ids(num_layers),
                                                  num_layers)]


def draft_vocab(kind: str, cfg, train_rows, vocab_size: int, eos_ids):
    """The draft vocabulary the recipe builds (`build_trainable`), or None for DFlash's full one."""
    from .kinds.vocab import build_draft_vocab

    size = cfg.draft.vocab_size
    if kind == "dflash" and not size:
        return None
    return build_draft_vocab([row["response_ids"] for row in train_rows], vocab_size, size, always_include=eos_ids)


def write_recipe_data(kind: str, config: str, overrides: Sequence[str], out_dir, *, limit: int | None = None,
                      dtype: str = "float32") -> DataSummary:
    """The recipe's training data (its cached target answers: the recipe runs first and writes them;
    answers missing from the cache are generated here exactly as the recipe would) in speculators' layout."""
    from .data.pipeline import prepare_distillation_data
    from .models import DTYPES, load_causal_lm, load_tokenizer, resolve_dtype
    from .tokens import eos_token_ids

    cfg = recipe_config(kind, config, overrides)
    if dtype not in DTYPES:
        raise UserError(f"unknown --dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(cfg.target, "target")
    target = load_causal_lm(cfg.target, resolve_dtype(cfg.target_dtype, device), device, "target")
    target.requires_grad_(False)
    data = prepare_distillation_data(cfg.data, target, tokenizer, target_path=cfg.target)
    eos = eos_token_ids(tokenizer, target, required=True)
    vocab = draft_vocab(kind, cfg, data.train, target.config.vocab_size, eos)
    layers = speculators_layer_ids(kind, cfg, target.config.num_hidden_layers)
    extra = {}
    if kind == "dflash":
        from .tokens import mask_token_id

        extra["mask_token_id"] = mask_token_id(tokenizer, cfg.draft.mask_token)
    rows = [(row["prompt_ids"], row["response_ids"]) for row in data.train]
    summary = write_speculators_data(out_dir, rows, target, layer_ids=layers, max_seq_len=cfg.data.max_seq_len,
                                     kind=kind, vocab=vocab, dtype=DTYPES[dtype], limit=limit, progress=True,
                                     extra=extra)
    return summary


# ----------------------------------------------------------------------------- matched settings


@dataclass
class SpeculatorsRun:
    argv: list[str]                # scripts/speculators_train.py's flags: `speculators train`'s and --samples-per-step
    matched: dict[str, str]        # setting -> how both sides get it
    unmatched: list[str]           # what the two trainers cannot be made to do alike


def speculators_argv(kind: str, cfg, summary: DataSummary, data_dir, save_dir, *, cpu: bool = True) -> SpeculatorsRun:
    """speculators' `train` flags that match drafttrain's recipe config `cfg` (as scripts/parity.sh runs
    it: optim.min_lr_ratio=0, train.keep_best=false and, for EAGLE-3, loss.teacher=hidden, which are
    what speculators can do) on the data `summary` describes."""
    if kind not in KINDS:
        raise UserError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    o, t = cfg.optim, cfg.train
    batch = t.micro_batch_size * t.gradient_accumulation_steps
    total_seq_len = cfg.data.max_seq_len  # raised by the launcher's --samples-per-step
    schedule = {"cosine": "cosine", "linear": "linear", "constant": "none"}[o.schedule]
    save = Path(save_dir)
    argv = ["--speculator-type", kind, "--verifier-name-or-path", cfg.target, "--data-path", str(data_dir),
            "--save-path", str(save / "checkpoints"), "--log-dir", str(save / "logs"),
            "--target-layer-ids", *map(str, summary.layer_ids),
            "--max-steps", str(t.max_steps), "--total-seq-len", str(total_seq_len), "--samples-per-step", str(batch),
            "--train-data-ratio", repr(summary.train_data_ratio), "--seed", str(t.seed),
            "--optimizer", "adamw", "--lr", repr(o.lr), "--weight-decay", repr(o.weight_decay),
            "--scheduler-type", schedule, "--scheduler-warmup-steps", str(o.warmup_steps),
            "--scheduler-total-steps", str(t.max_steps),
            "--hidden-states-dtype", summary.hidden_dtype, "--num-workers", "0", "--on-missing", "raise",
            "--log-freq", str(t.log_every), "--no-resume-from-checkpoint"]
    if cpu:  # flex attention has no backward on a CPU; the fused losses need Triton
        argv += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    if summary.draft_vocab_size:
        argv += ["--draft-vocab-size", str(summary.draft_vocab_size)]
    matched = {
        "target and data": "the same target, prompts and target answers (drafttrain's cache), cut to "
                           f"data.max_seq_len {cfg.data.max_seq_len} alike; {summary.rows} rows",
        "target layers": f"{summary.layer_ids} (speculators' numbering: the input of layer i)",
        "draft vocabulary": (f"drafttrain's {summary.draft_vocab_size} tokens (d2t/t2d files)"
                             if summary.draft_vocab_size else "the target's whole vocabulary"),
        "steps": f"{t.max_steps} (epochs set so that speculators stops there)",
        "optimizer": f"AdamW, lr {o.lr}, weight decay {o.weight_decay}, betas (0.9, 0.999), eps 1e-8, "
                     "gradient norm clipped at 1.0",
        "schedule": f"{o.warmup_steps} warm-up steps, then {o.schedule} decay to 0 at step {t.max_steps}",
        "seed": str(t.seed),
        "precision": f"{summary.hidden_dtype} features, float32 weights",
        "exported weights": "the last step's (drafttrain: train.keep_best=false)",
    }
    unmatched = [
        f"batch: drafttrain {batch} sequences a step, padded; speculators packs whole sequences into one row of "
        f"at most --total-seq-len tokens, set by the launcher (--samples-per-step {batch}) to the shortest that "
        f"averages {batch} or more sequences a step; the count varies step to step (speed.json: samples_per_step)",
        "warm-up: drafttrain's lr goes (s+1)/(w+1), speculators' s/w (transformers' schedules)",
        "initialisation: each trainer its own (drafttrain starts the LM head and final norm from the target's)",
        "exported dtype: speculators writes bfloat16 weights, drafttrain float32 (export_dtype)",
        "features: drafttrain computes the target's hidden states online (features.keep_in_memory keeps them); "
        "speculators reads them from files written before training (here by `drafttrain.parity data`, standing "
        "in for vLLM's extraction): its samples/s leaves out the target's forward",
    ]
    if kind == "eagle3":
        argv += ["--num-layers", "1", "--draft-arch", "llama", "--no-norm-before-residual", "--no-norm-before-fc",
                 "--no-norm-output", "--ttt-steps", str(cfg.loss.ttt_steps),
                 "--ttt-step-loss-decay", repr(cfg.loss.decay), "--loss-fn", "kl_div"]
        matched |= {
            "architecture": "one Llama layer, residual before hidden_norm, no norm before fc, pre-norm output fed "
                            "back (drafttrain's and vLLM's plain EAGLE-3: speculators' --no-norm-before-residual "
                            "--no-norm-before-fc --no-norm-output; its defaults are its 'EAGLE 3.1' variant)",
            "training-time test": f"{cfg.loss.ttt_steps} steps, step j weighted {cfg.loss.decay}^j",
            "loss": "forward KL to the target's distribution over the draft vocabulary (drafttrain "
                    "loss.teacher=hidden)",
            "trained positions": "the draft of every answer token",
        }
        unmatched.append("loss scale: drafttrain normalises the step weights to sum 1, speculators sums them "
                         f"(x{sum(cfg.loss.decay ** j for j in range(cfg.loss.ttt_steps)):.2f}); AdamW is "
                         "indifferent to the scale but the gradient clipping is not")
    else:
        d = cfg.draft
        anchors = cfg.loss.anchors * batch
        gamma = cfg.loss.decay_length or d.block_size / 2
        mask = summary.extra.get("mask_token_id")
        if mask is None:
            raise UserError("the DFlash parity data has no mask_token_id; write it again with "
                            "`python -m drafttrain.parity data --kind dflash`")
        argv += ["--num-layers", str(d.layers), "--block-size", str(d.block_size), "--mask-token-id", str(mask),
                 "--max-anchors", str(anchors), "--sliding-window-non-causal", "--loss-fn", "ce",
                 "--per-position-loss-weight", "fixed-exp-decay", "--dflash-decay-gamma", repr(float(gamma))]
        matched |= {
            "architecture": f"{d.layers} Qwen3 layer(s), blocks of {d.block_size}, non-causal inside the block "
                            "(speculators --sliding-window-non-causal: its draft layers are sliding-window ones "
                            "of 2048 tokens, longer than any row here)",
            "mask token": f"id {mask}",
            "loss": f"cross-entropy to the target's greedy token, slot j weighted exp(-(j-1)/{gamma:g})",
            "trained positions": "blocks anchored from the prompt's last token, every answer token a label",
        }
        unmatched += [
            f"anchors: drafttrain {cfg.loss.anchors} per answer; speculators {anchors} per packed row "
            f"(--max-anchors = {cfg.loss.anchors} x {batch}), never in the row's last {d.block_size} positions",
            "mask embedding: drafttrain trains its own (mask_embedding.pt); speculators uses the target's "
            f"embedding of token {mask}, frozen",
        ]
    return SpeculatorsRun(argv, matched, unmatched)


# ----------------------------------------------------------------------------- exports


def _speculators_checkpoint(path, kind: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights = path / "config.json", path / "model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise UserError(f"{path} is not a speculators checkpoint (config.json and model.safetensors)")
    cfg = json.loads(config_file.read_text())
    if cfg.get("speculators_model_type") != kind:
        raise UserError(f"{config_file}: speculators_model_type is {cfg.get('speculators_model_type')!r}, not "
                        f"{kind!r}")
    return cfg, load_file(str(weights))


def convert_eagle3_export(checkpoint, out_dir, target) -> Path:
    """speculators' EAGLE-3 checkpoint -> drafttrain's (and vLLM's, SGLang's) EAGLE-3 layout, the same
    weights (speculators' dtype). Only its plain variant (--no-norm-before-residual --no-norm-before-fc
    --no-norm-output, as parity.sh trains it) has that layout."""
    from .kinds.eagle3.export import save_eagle3
    from .kinds.eagle3.model import Eagle3Config, Eagle3Draft

    cfg, state = _speculators_checkpoint(checkpoint, "eagle3")
    variant = [k for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if cfg.get(k)]
    if variant:
        raise UserError(f"{checkpoint}: trained with {', '.join(variant)}, which drafttrain's EAGLE-3 has not; "
                        "train with --no-norm-before-residual --no-norm-before-fc --no-norm-output, or judge it "
                        "by vLLM alone")
    layers = cfg["transformer_layer_config"].get("num_hidden_layers", 1)
    if layers != 1:
        raise UserError(f"{checkpoint}: {layers} draft layers; drafttrain's EAGLE-3 has one")
    config = Eagle3Config.from_target(target.config, int(cfg["draft_vocab_size"]),
                                      cfg.get("eagle_aux_hidden_state_layer_ids"))
    state.pop("embed_tokens.weight", None)
    state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    if "d2t" not in state:  # a full-vocabulary draft
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    dtype = state["fc.weight"].dtype
    draft = Eagle3Draft(config).to(dtype)
    draft.load_state_dict(state)
    info = {"target": str(getattr(target, "name_or_path", "")),
            "recipe": f"speculators {cfg.get('speculators_version', '?')} (converted by drafttrain.parity)"}
    return save_eagle3(draft, out_dir, base_info=info)


def convert_dflash_export(checkpoint, out_dir, target) -> Path:
    """speculators' DFlash checkpoint -> drafttrain's DFlash layout (vLLM's DFlashDraftModel), the same
    weights. speculators feeds the mask slots the target's embedding of mask_token_id, which becomes
    mask_embedding.pt here; a full-vocabulary draft's LM head is the target's."""
    from .kinds.dflash.export import save_dflash
    from .kinds.dflash.model import DFlashConfig, DFlashDraft

    cfg, state = _speculators_checkpoint(checkpoint, "dflash")
    if cfg.get("sample_from_anchor"):
        raise UserError(f"{checkpoint}: sample_from_anchor drafts the anchor's slot too; DFlash's layout has no "
                        "such draft")
    ids = [int(i) - 1 for i in cfg["aux_hidden_state_layer_ids"]]
    mask = int(cfg["mask_token_id"])
    config = DFlashConfig.from_target(target.config, int(cfg["draft_vocab_size"]),
                                      layers=int(cfg["transformer_layer_config"]["num_hidden_layers"]),
                                      block_size=int(cfg["block_size"]), target_layer_ids=ids, mask_token_id=mask)
    config.causal = not cfg.get("sliding_window_non_causal", False)
    renamed = {}
    for key, value in state.items():
        for sub in ("self_attn.", "mlp."):
            key = key.replace(sub, "")
        renamed[key] = value
    dtype = renamed["fc.weight"].dtype
    embedding = target.get_input_embeddings().weight.detach()
    renamed["mask_embedding"] = embedding[mask].to(dtype)
    if "lm_head.weight" not in renamed:
        renamed["lm_head.weight"] = target.get_output_embeddings().weight.detach().to(dtype)
        renamed["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        renamed["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    draft = DFlashDraft(config).to(dtype)
    draft.load_state_dict(renamed)
    info = {"target": str(getattr(target, "name_or_path", "")), "block size": config.block_size,
            "recipe": f"speculators {cfg.get('speculators_version', '?')} (converted by drafttrain.parity)"}
    return save_dflash(draft, out_dir, base_info=info)


# ----------------------------------------------------------------------------- the report


def drafttrain_speed(run_dir) -> dict:
    """Training steps, samples and samples/s of a drafttrain recipe run (its train_log.jsonl windows,
    evaluations excluded; its batch from config.yaml)."""
    import yaml

    run = Path(run_dir)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    batch = cfg["train"]["micro_batch_size"] * cfg["train"].get("gradient_accumulation_steps", 1)
    steps, seconds, last = 0, 0.0, 0
    for line in (run / "train_log.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("type") != "train" or not row.get("steps_per_s"):
            continue
        window = row["step"] - last
        last = row["step"]
        steps += window
        seconds += window / row["steps_per_s"]
    samples = steps * batch
    return {"steps": steps, "samples": samples, "seconds": seconds, "samples_per_step": batch,
            "samples_per_s": samples / seconds if seconds else 0.0}


def _acceptance(values: Sequence[float], width: int) -> str:
    return " / ".join(f"{v:.2f}" for v in list(values)[:width])


def report(out_dir, kinds: Sequence[str]) -> str:
    """The markdown side-by-side of a scripts/parity.sh run directory."""
    out = Path(out_dir)
    lines = ["| drafter | trainer | judge | K | tau | per-position acceptance | outputs = target's |",
             "|---|---|---|---|---|---|---|"]
    speed = ["| drafter | trainer | steps | samples/step | samples/s | what the time covers |", "|---|---|---|---|---|---|"]
    notes: list[str] = []
    for kind in kinds:
        judge = out / f"judge-{kind}" / "comparison.json"
        if judge.is_file():
            comparison = json.loads(judge.read_text())
            for row in comparison["drafters"]:
                name = row["drafter"]
                trainer = "drafttrain" if name.startswith("drafttrain") else "speculators"
                per = row.get("per_position_acceptance") or []
                match = row.get("outputs_match_baseline")
                lines.append(f"| {kind} | {trainer} | {row.get('backend', '?')} | {row.get('num_draft_tokens', '?')} | "
                             f"{row['tau']:.3f} | {_acceptance(per, len(per))} | "
                             f"{'-' if match is None else f'{match:.2f}'} |")
        dt_run = out / f"drafttrain-{kind}"
        if (dt_run / "train_log.jsonl").is_file():
            d = drafttrain_speed(dt_run)
            speed.append(f"| {kind} | drafttrain | {d['steps']} | {d['samples_per_step']:g} | {d['samples_per_s']:.2f} | "
                         "steps, the target's forward for its features included |")
        spec = out / f"speculators-{kind}" / "speed.json"
        if spec.is_file():
            d = json.loads(spec.read_text())
            speed.append(f"| {kind} | speculators | {d['steps']} | {d['samples_per_step']:.2f} | {d['samples_per_s']:.2f} | "
                         "steps on stored features |")
        hs = out / f"data-{kind}" / DATA_META
        seconds = out / f"data-{kind}.seconds"
        if hs.is_file() and seconds.is_file():
            rows = json.loads(hs.read_text())["rows"]
            took = float(seconds.read_text())
            speed.append(f"| {kind} | (speculators' features) | - | - | {rows / took:.2f} | the target's hidden "
                         f"states of {rows} rows, written once ({took:.0f} s) |")
        settings = out / f"settings-{kind}.json"
        if settings.is_file():
            s = json.loads(settings.read_text())
            notes.append(f"**{kind}: matched**")
            notes += [f"- {key}: {value}" for key, value in s["matched"].items()]
            notes.append(f"\n**{kind}: not matched**")
            notes += [f"- {item}" for item in s["unmatched"]]
            notes.append("")
    return "\n".join(["### Held-out acceptance (one judge each row: drafttrain's decoder or vLLM serving the export)",
                      "", *lines, "", "### Training speed (same machine)", "", *speed, "", "### Settings", "",
                      *notes]) + "\n"


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m drafttrain.parity", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="write a recipe's training data in speculators' layout")
    data.add_argument("--kind", choices=KINDS, required=True)
    data.add_argument("--config", required=True)
    data.add_argument("--out", required=True)
    data.add_argument("--limit", type=int, default=None, help="the first N training rows only (toy runs)")
    data.add_argument("--dtype", default="float32", help="dtype of the stored hidden states")
    data.add_argument("overrides", nargs="*", help="key=value overrides of the recipe config")
    args_cmd = sub.add_parser("argv", help="speculators' train flags matching a recipe config (one a line), and "
                                           "matched.json")
    args_cmd.add_argument("--kind", choices=KINDS, required=True)
    args_cmd.add_argument("--config", required=True)
    args_cmd.add_argument("--data", required=True)
    args_cmd.add_argument("--save", required=True)
    args_cmd.add_argument("--gpu", action="store_true", help="flex attention and fused losses (a CUDA machine)")
    args_cmd.add_argument("--settings-out", default=None, help="write what is matched and what not, as JSON")
    args_cmd.add_argument("overrides", nargs="*")
    export = sub.add_parser("export", help="a speculators checkpoint in drafttrain's (and vLLM's) layout")
    export.add_argument("--kind", choices=KINDS, required=True)
    export.add_argument("--checkpoint", required=True)
    export.add_argument("--target", required=True)
    export.add_argument("--out", required=True)
    table = sub.add_parser("report", help="the markdown side-by-side of a scripts/parity.sh run directory")
    table.add_argument("--dir", required=True)
    table.add_argument("--kinds", nargs="+", default=list(KINDS))
    args = parser.parse_args(argv)
    try:
        if args.command == "data":
            summary = write_recipe_data(args.kind, args.config, args.overrides, args.out, limit=args.limit,
                                        dtype=args.dtype)
            print(f"{summary.rows} rows, {summary.tokens} tokens, layers {summary.layer_ids}, draft vocabulary "
                  f"{summary.draft_vocab_size or 'full'} -> {args.out}")
        elif args.command == "argv":
            cfg = recipe_config(args.kind, args.config, args.overrides)
            run = speculators_argv(args.kind, cfg, read_data_summary(args.data), args.data, args.save,
                                   cpu=not args.gpu)
            if args.settings_out:
                Path(args.settings_out).write_text(json.dumps({"argv": run.argv, "matched": run.matched,
                                                               "unmatched": run.unmatched}, indent=2) + "\n")
            print("\n".join(run.argv))
        elif args.command == "report":
            print(report(args.dir, args.kinds), end="")
        else:
            from .models import load_causal_lm

            target = load_causal_lm(args.target, torch.float32, torch.device("cpu"), "target")
            convert = convert_eagle3_export if args.kind == "eagle3" else convert_dflash_export
            print(convert(args.checkpoint, args.out, target))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
