"""Greedy acceptance of draft models replayed against the target outputs a report already holds.

    python eval/replay.py --target T --prompts humaneval.jsonl --outputs runs/demo/report/ngram/outputs.jsonl \
        --draft initial=runs/demo/distill-forward_kl/initial --draft distilled=runs/demo/distill-forward_kl/final

Any report's outputs.jsonl carries the target's own greedy tokens (`baseline_token_ids`, or the
speculative ones, identical under greedy decoding). One forward pass of a draft over them gives
exactly the accepted lengths real greedy decoding would (drafttrain.teacher_forced), so dozens of
candidate drafts compare in seconds each. Acceptance only: speed needs `drafttrain compare`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafttrain.errors import UserError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the target (for its tokenizer): directory or hub id")
    p.add_argument("--prompts", required=True, help="the prompt file the report ran (SPEC section 1)")
    p.add_argument("--outputs", required=True, help="a report's outputs.jsonl (greedy run)")
    p.add_argument("--draft", action="append", required=True, metavar="NAME=DIR", help="a draft model; repeatable")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, required=True, help="the report's --max-new-tokens")
    args = p.parse_args(argv)
    try:
        return run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    import torch

    from drafttrain.models import load_causal_lm, load_tokenizer
    from drafttrain.prompts import encode_prompt, read_prompt_file
    from drafttrain.teacher_forced import tau, teacher_forced_accepted_lengths

    outputs = {}
    for line in Path(args.outputs).read_text().splitlines():
        row = json.loads(line)
        tokens = row.get("baseline_token_ids") or row.get("speculative_token_ids")
        outputs[str(row["id"])] = tokens
    tokenizer = load_tokenizer(args.target, "target")
    prompts = [(str(r.id), encode_prompt(r, tokenizer)) for r in read_prompt_file(args.prompts)]
    prompts = [(i, ids) for i, ids in prompts if i in outputs]
    if not prompts:
        raise UserError(f"no prompt of {args.prompts} has an output in {args.outputs}; pass the prompt file the report ran")
    print(f"{len(prompts)} prompts, K={args.num_draft_tokens}")
    for spec in args.draft:
        name, _, path = spec.partition("=")
        if not path:
            raise UserError(f"--draft {spec!r}: write NAME=DIR")
        draft = load_causal_lm(path, torch.float32, torch.device("cpu"), "draft").eval()
        lengths, tokens, per_prompt = [], 0, []
        for pid, ids in prompts:
            acc = teacher_forced_accepted_lengths(draft, ids, outputs[pid], num_draft_tokens=args.num_draft_tokens,
                                                  max_new_tokens=args.max_new_tokens)
            lengths += acc
            tokens += len(outputs[pid])
            per_prompt.append(f"{tau(len(outputs[pid]), acc):.2f}")
        print(f"{name}: tau {tau(tokens, lengths):.3f}  per prompt {' '.join(per_prompt)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
