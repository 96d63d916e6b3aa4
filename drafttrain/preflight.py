"""Draft/target agreement checks, run before any decoding.

Speculative decoding compares token ids, so a draft is only usable if its tokenizer maps every
token to the same id as the target's and stops on the same EOS. A draft whose embedding matrix
is padded past its tokenizer is fine: the decoder ignores ids the tokenizer never produces.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import add_command, setting
from .errors import UserError
from .tokens import eos_token_ids, output_vocab_size


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def first_vocab_difference(target_vocab: dict[str, int], draft_vocab: dict[str, int]) -> str | None:
    for token, tid in sorted(target_vocab.items(), key=lambda kv: kv[1]):
        if token not in draft_vocab:
            return f"token {token!r} (target id {tid}) is missing from the draft's vocabulary"
        if draft_vocab[token] != tid:
            return f"token {token!r} has id {tid} in the target but {draft_vocab[token]} in the draft"
    for token, tid in sorted(draft_vocab.items(), key=lambda kv: kv[1]):
        if token not in target_vocab:
            return f"token {token!r} (draft id {tid}) is missing from the target's vocabulary"
    return None


def compatibility_checks(target_model, target_tok, draft_model, draft_tok) -> list[Check]:
    checks = []
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    diff = first_vocab_difference(t_vocab, d_vocab)
    checks.append(Check("token-to-id map", diff is None,
                        diff or f"{len(t_vocab)} tokens, identical ids (special tokens included)"))
    t_special = {k: str(v) for k, v in target_tok.special_tokens_map.items()}
    d_special = {k: str(v) for k, v in draft_tok.special_tokens_map.items()}
    bad = [k for k in sorted(set(t_special) | set(d_special)) if t_special.get(k) != d_special.get(k)]
    checks.append(Check("special tokens", not bad,
                        f"{bad[0]}: target {t_special.get(bad[0])!r}, draft {d_special.get(bad[0])!r}" if bad
                        else ", ".join(f"{k}={v}" for k, v in sorted(t_special.items()))))
    t_eos = set(eos_token_ids(target_tok, target_model))
    d_eos = set(eos_token_ids(draft_tok, draft_model))
    checks.append(Check("EOS", t_eos == d_eos, f"target {sorted(t_eos)}, draft {sorted(d_eos)}"))
    n_tok = len(target_tok)
    for who, model in (("target", target_model), ("draft", draft_model)):
        rows = output_vocab_size(model)
        checks.append(Check(f"{who} output vocabulary covers the tokenizer", rows >= n_tok,
                            f"{rows} logits for {n_tok} tokens"))
    return checks


def require_compatible(checks: list[Check]) -> None:
    for check in checks:
        if not check.ok:
            raise UserError(f"draft and target disagree ({check.name}): {check.detail}; "
                            "use a draft trained with the target's tokenizer")


@dataclass(kw_only=True)
class PreflightConfig:
    """`drafttrain preflight`: its flags, declared once (`config.setting`)."""

    target: str = setting(doc="Target model: a local directory or a hub id.", metavar="T")
    draft: str = setting(doc="Draft model to check against the target: a directory or hub id.", metavar="DIR")


def add_cli(sub) -> None:
    add_command(sub, "preflight", PreflightConfig, run_cli, help="check that a draft can be used with a target")


def run_cli(cfg: PreflightConfig) -> int:
    import torch

    from .models import load_causal_lm, load_tokenizer

    target_tok, draft_tok = load_tokenizer(cfg.target, "target"), load_tokenizer(cfg.draft, "draft")
    cpu = torch.device("cpu")
    target = load_causal_lm(cfg.target, torch.float32, cpu, "target")
    draft = load_causal_lm(cfg.draft, torch.float32, cpu, "draft")
    checks = compatibility_checks(target, target_tok, draft, draft_tok)
    for check in checks:
        print(f"[{'ok' if check.ok else 'FAIL'}] {check.name}: {check.detail}")
    require_compatible(checks)
    print("draft and target are compatible")
    return 0
