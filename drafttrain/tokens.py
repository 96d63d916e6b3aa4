"""Token-id facts every stage needs about a model and its tokenizer, each decided in one place.

- `eos_token_ids`: the tokens that end a turn. Instruct models often stop on several (the
  tokenizer's EOS, e.g. `<|im_end|>`, and the ones the generation config adds, e.g.
  `<|endoftext|>`), and training, generation, decoding and export must all agree on them.
- `pad_token_id`: the id that fills padded positions (always masked, so any id works; the
  tokenizer's pad, else the first EOS).
- `output_vocab_size`: the number of logits the model emits, which may exceed the tokenizer's
  length (embeddings padded to a multiple of 64).
- `left_pad` / `cut_at_eos`: the two sequence operations around batched `generate` calls.
- `mask_token_id`: the id a parallel or block draft's mask slots hold.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .errors import UserError


def eos_token_ids(tokenizer=None, model=None, *, required: bool = False) -> list[int]:
    """The tokenizer's EOS first, then the model's generation config's EOS ids (an int or a list),
    falling back to `model.config.eos_token_id` when the generation config names none (what
    `generate` itself would use). No duplicates; the first is the one a single-id field gets.

    Empty when nothing names an EOS: such a model never stops on its own and decoding runs to
    its token limit. `required=True` turns that into a UserError (training needs answers that end).
    """
    candidates: list = [getattr(tokenizer, "eos_token_id", None)]
    generation = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if generation is None:
        generation = getattr(getattr(model, "config", None), "eos_token_id", None)
    candidates += list(generation) if isinstance(generation, (list, tuple)) else [generation]
    ids: list[int] = []
    for i in candidates:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    if required and not ids:
        raise UserError("the target names no end-of-sequence token (neither its tokenizer's eos_token nor its "
                        "generation config's eos_token_id); set eos_token_id in the model's generation_config.json")
    return ids


def pad_token_id(tokenizer, model=None) -> int:
    """The tokenizer's pad token, else the first EOS (`eos_token_ids`); pad positions are always masked."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    return eos_token_ids(tokenizer, model, required=True)[0]


def output_vocab_size(model) -> int:
    """Rows of the model's LM head: how many logits it emits per position."""
    weight = model.get_output_embeddings().weight
    return int(getattr(weight, "ds_shape", weight.shape)[0])  # ds_shape: a ZeRO-3 partition's full shape


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding keeps every row's last prompt token in the last column, where generation continues."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for j, r in enumerate(rows):
        if r:
            input_ids[j, width - len(r):] = torch.tensor(r, dtype=torch.long)
            attention_mask[j, width - len(r):] = 1
    return input_ids.to(device), attention_mask.to(device)


def cut_at_eos(tokens: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """Up to and including the first EOS; what follows is padding of a finished row."""
    eos = set(eos_ids)
    for t, tok in enumerate(tokens):
        if tok in eos:
            return list(tokens[: t + 1])
    return list(tokens)


__all__ = ["cut_at_eos", "eos_token_ids", "left_pad", "output_vocab_size", "pad_token_id"]


def mask_token_id(tokenizer, choice: int | str = "auto") -> int:
    """The token id a parallel or DFlash draft's mask slots hold: `choice` (an id or a token), or, for "auto",
    the last added token that is not one of the tokenizer's special tokens (e.g. SmolLM2's
    `<empty_output>`): an existing embedding row that ordinary text never produces."""
    if choice != "auto":
        ids = tokenizer.convert_tokens_to_ids(choice) if isinstance(choice, str) else choice
        if not isinstance(ids, int) or not 0 <= ids < len(tokenizer):
            raise UserError(f"draft.mask_token {choice!r} is not a token of the target's tokenizer; give a token id "
                            f"below {len(tokenizer)} or an added token such as a reserved special token")
        return ids
    special = set(tokenizer.all_special_ids)
    added = sorted(i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i not in special)
    if not added:
        raise UserError("the target's tokenizer has no spare added token to use as the draft's mask; set "
                        "draft.mask_token to a token id that the training text never contains")
    return added[-1]
