"""Teacher-forced replay (`drafttrain replay`) must give exactly what greedy speculative decoding
gives, step for step: accepted AND proposed lengths, drafts past an EOS not counted."""

import json
import re

import pytest
import torch
from eval_helpers import cli, damaged_copy, one_error_line, snapshot, write_jsonl
from tiny import greedy_reference, noisy_copy, save_pair, tiny_lm, tiny_tokenizer

from drafttrain.cli import main
from drafttrain.kinds.draft_lm.decode import DraftModelProposer
from drafttrain.decoding import ChainDecoder
from drafttrain.kinds.draft_lm.kind import draft_lm_drafter
from drafttrain.evaluation.replay import (ReplayConfig, chain_accepted_lengths, chain_steps, run_replay, tau,
                                          teacher_forced_steps)

PROMPTS = [[5, 9, 13, 7, 5, 9], [40], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 5]]


def test_chain_rule_by_hand():
    T, F = True, False
    # K=2: step 1 accepts 2 (t=0,1) and emits 3; step 2 at t=3 rejects; step 3 at t=4 accepts 1, emits 2.
    assert chain_accepted_lengths([T, T, F, F, T, F], 2, 100) == [2, 0, 1]
    # At the length limit a step drafts at most tokens-left - 1 tokens.
    assert chain_steps([T, T, T, T], 4, 4, ended_at_eos=False) == ([3], [3])
    # The target stopped at an EOS (3 < 10 tokens): a draft matching through the EOS emits nothing
    # past it, and its 4th draft, past the EOS, is not counted as proposed.
    assert chain_steps([T, T, T], 4, 10, ended_at_eos=True) == ([3], [3])
    # The draft misses the EOS: the EOS is the target's own token, drafts 3 and 4 are past it.
    assert chain_steps([T, F], 4, 10, ended_at_eos=True) == ([1], [2])
    # One step emits 2 (d1 + the target's token), the next one the EOS alone: 1 of its 4 drafts counts.
    assert chain_steps([T, F, F], 4, 10, ended_at_eos=True) == ([1, 0], [4, 1])
    assert chain_steps([T, T, F, T, F], 2, 10, ended_at_eos=True) == ([2, 1], [2, 2])
    assert tau(6, [2, 0, 1]) == pytest.approx(6 / 3)
    assert tau(3, [3]) == 3.0  # matched through the EOS: 3 tokens in one step, not accepted + 1


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("scale", [0.0, 0.05, 0.2])
def test_equals_the_decoders_accepted_and_proposed_lengths(k, scale):
    target = tiny_lm(0)
    draft = noisy_copy(target, scale=scale)
    steps = 0
    for prompt in PROMPTS:
        for max_new, eos in ((25, set()), (30, None)):
            output = greedy_reference(target, prompt, max_new)
            if eos is None:  # an EOS inside the output: the target stops there
                eos = {output[13]}
                output = greedy_reference(target, prompt, max_new, eos=output[13])
            decoder = ChainDecoder(target, DraftModelProposer(draft, 64),
                                         num_draft_tokens=k, eos_token_ids=eos)
            real = decoder.generate(prompt, max_new)
            assert real.tokens == output
            accepted, proposed = teacher_forced_steps(draft_lm_drafter(draft), prompt, output, num_draft_tokens=k,
                                                      max_new_tokens=max_new)
            assert accepted == real.accepted_lengths
            assert proposed == real.proposed_lengths
            if scale == 0.0:  # the target as its own draft: every counted draft accepted
                assert accepted == proposed
            steps += len(accepted)
            assert any(accepted) or scale > 0.1
    assert steps > 0


@pytest.mark.parametrize("k", [2, 4])
def test_a_parallel_draft_equals_the_decoders_lengths(k):
    """A draft whose config names pard_token replays as a parallel draft: its step's draft j comes
    from depth j of one laid-out forward, as the decoder's one forward over [sequence, masks]."""
    from drafttrain.kinds.parallel_lm.decode import ParallelDraftProposer
    from drafttrain.kinds.parallel_lm.model import mark_parallel

    target = tiny_lm(0)
    draft = noisy_copy(target, scale=0.05)
    mark_parallel(draft, 9, k)
    steps = 0
    for prompt in PROMPTS:
        output = greedy_reference(target, prompt, 25)
        decoder = ChainDecoder(target, ParallelDraftProposer(draft, 64, 9), num_draft_tokens=k)
        real = decoder.generate(prompt, 25)
        accepted, proposed = teacher_forced_steps(draft_lm_drafter(draft), prompt, output, num_draft_tokens=k,
                                                  max_new_tokens=25)
        assert (accepted, proposed) == (real.accepted_lengths, real.proposed_lengths)
        steps += len(accepted)
    assert steps > 0


# ---------------------------------------------------------------------------------------------
# The command, against a real greedy report.

MAX_NEW = 14
K = 3


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    tok = tiny_tokenizer(64)
    target = tiny_lm(0, dtype=torch.float64)
    with torch.no_grad():
        target.lm_head.weight[2] *= 2.0  # some outputs end at EOS (id 2) before MAX_NEW
    save_pair(root / "target", target, tok)
    save_pair(root / "draft", noisy_copy(target, scale=0.1), tok)
    damaged_copy(root / "draft", root / "nan-draft", "nan")
    damaged_copy(root / "draft", root / "truncated-draft", "truncated")
    save_pair(root / "swapped-draft", noisy_copy(target, scale=0.1), tok)  # two token ids traded:
    spec = json.loads((root / "swapped-draft" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["w10"], vocab["w11"] = vocab["w11"], vocab["w10"]
    (root / "swapped-draft" / "tokenizer.json").write_text(json.dumps(spec))
    prompts = write_jsonl(root / "p.jsonl", [{"id": f"p{i}", "prompt": f"w{5 + i} w{9 + 2 * i} w{13 + i} w7"}
                                             for i in range(6)])
    assert main(["eval", "--target", str(root / "target"), "--draft", str(root / "draft"), "--prompts", prompts,
                 "--num-draft-tokens", str(K), "--max-new-tokens", str(MAX_NEW), "--dtype", "float64",
                 "--out", str(root / "report"), "--quiet"]) == 0
    rows = [json.loads(line) for line in (root / "report" / "outputs.jsonl").read_text().splitlines()]
    assert any(len(r["baseline_token_ids"]) < MAX_NEW for r in rows)  # an EOS ends some outputs
    return root


def replay_argv(root, *drafts, outputs=None, prompts=None):
    return ["replay", "--target", str(root / "target"), "--prompts", prompts or str(root / "p.jsonl"),
            "--outputs", outputs or str(root / "report" / "outputs.jsonl"),
            *[x for d in drafts for x in ("--draft", d)], "--num-draft-tokens", str(K), "--dtype", "float64", "--quiet"]


def test_replay_reproduces_the_reports_steps_exactly(report):
    rows = [json.loads(line) for line in (report / "report" / "outputs.jsonl").read_text().splitlines()]
    cfg = ReplayConfig(target=str(report / "target"), prompts=[str(report / "p.jsonl")],
                       outputs=str(report / "report" / "outputs.jsonl"), draft=[f"d={report / 'draft'}"],
                       num_draft_tokens=K, dtype="float64")
    (result,) = run_replay(cfg, progress=False)
    assert result.max_new_tokens == MAX_NEW  # read from the report.json beside the outputs
    assert result.accepted == [r["accepted_lengths"] for r in rows]
    assert result.proposed == [r["proposed_lengths"] for r in rows]
    overall = json.loads((report / "report" / "report.json").read_text())["overall"]
    assert result.tau == pytest.approx(overall["mean_accepted_length"], abs=1e-12)
    assert result.acceptance_rate == pytest.approx(overall["acceptance_rate"], abs=1e-12)


def test_replay_command_prints_tau_and_acceptance(report, capsys):
    code, out, err = cli(capsys, replay_argv(report, f"noisy={report / 'draft'}", f"self={report / 'target'}"))
    assert code == 0, err
    overall = json.loads((report / "report" / "report.json").read_text())["overall"]
    lines = [line for line in out.splitlines() if not line.startswith("  ")]  # each draft's line, its windows below
    assert lines[0].startswith(f"noisy: tau {overall['mean_accepted_length']:.3f}, "
                               f"acceptance {overall['acceptance_rate']:.3f} over 6 prompts (K={K}, max new tokens "
                               f"{MAX_NEW})")
    assert re.match(r"self: tau [\d.]+, acceptance 1\.000 ", lines[1])  # the target as draft: 1.0, EOS or not


def test_replay_bad_inputs_are_one_error_line(report, tmp_path, capsys):
    sampled = tmp_path / "sampled"
    sampled.mkdir()
    (sampled / "outputs.jsonl").write_text((report / "report" / "outputs.jsonl").read_text())
    (sampled / "report.json").write_text(json.dumps({"config": {"temperature": 0.7, "max_new_tokens": MAX_NEW}}))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "outputs.jsonl").write_text((report / "report" / "outputs.jsonl").read_text())
    garbled = tmp_path / "garbled.jsonl"
    garbled.write_text('{"id": "p0", "baseline_token_ids": [5]}\n{"id": \n')
    other_prompts = write_jsonl(tmp_path / "other.jsonl", [{"id": "zz", "prompt": "w5"}])
    good = f"d={report / 'draft'}"
    cases = [
        (replay_argv(report, good, outputs=str(tmp_path / "none.jsonl")), ["--outputs", "no such file"]),
        (replay_argv(report, good, outputs=str(garbled)), [f"{garbled}:2", "outputs.jsonl"]),
        (replay_argv(report, good, outputs=str(sampled / "outputs.jsonl")), ["sampled", "greedy"]),
        (replay_argv(report, good, outputs=str(bare / "outputs.jsonl")), ["--max-new-tokens"]),
        (replay_argv(report, good, prompts=other_prompts), ["no prompt", "output"]),
        (replay_argv(report, str(report / "draft")), ["NAME=DIR"]),
        (replay_argv(report, f"n={report / 'nan-draft'}"), ["draft 'n'", "non-finite"]),
        (replay_argv(report, f"t={report / 'truncated-draft'}"), ["draft 't'", "damaged"]),
        (replay_argv(report, f"m={tmp_path / 'missing'}"), ["draft 'm'", "not a directory"]),
        (replay_argv(report, f"s={report / 'swapped-draft'}"), ["draft 's'", "'w10'", "tokenizer"]),
        (replay_argv(report, good) + ["--max-new-tokens", "3"], ["--max-new-tokens 3", f"report's {MAX_NEW}"]),
        (replay_argv(report, good, outputs=str(bare / "outputs.jsonl")) + ["--max-new-tokens", "3"],
         ["more than --max-new-tokens 3"]),
    ]
    for argv, words in cases:
        before = snapshot(report)
        one_error_line(*cli(capsys, argv), *words)
        assert snapshot(report) == before


def copy_report(report, dst, edit_report=None, edit_row=None):
    """A copy of the report's outputs.jsonl and report.json, each optionally edited."""
    dst.mkdir()
    data = json.loads((report / "report" / "report.json").read_text())
    (dst / "report.json").write_text(json.dumps(edit_report(data) if edit_report else data))
    rows = [json.loads(line) for line in (report / "report" / "outputs.jsonl").read_text().splitlines()]
    write_jsonl(dst / "outputs.jsonl", [edit_row(r) if edit_row else r for r in rows])
    return str(dst / "outputs.jsonl")


def out_of_vocabulary(row):
    return {**row, "baseline_token_ids": row["baseline_token_ids"][:-1] + [1000]} if row["id"] == "p3" else row


def older_report(data):
    """A report from before `inputs` was recorded: only config.target names the target."""
    return {k: v for k, v in data.items() if k != "inputs"}


def test_replay_refuses_mismatched_inputs(report, tmp_path, capsys):
    """Outputs of another target replayed to tau 1.0 for that target as draft, other prompts under the
    same ids to a wrong tau, a token past the vocabulary was an IndexError, a duplicate --draft name
    and a --max-new-tokens above the report's passed silently: each is now one error line."""
    tok = tiny_tokenizer(64)
    save_pair(tmp_path / "other", tiny_lm(1, dtype=torch.float64), tok)
    other = str(tmp_path / "other")
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"id": f"p{i}", "prompt": f"w{30 + i} w{20 + i} w7"}
                                                       for i in range(6)])
    partial = write_jsonl(tmp_path / "partial.jsonl", [{"id": f"p{i}", "prompt": f"w{5 + i} w{9 + 2 * i} w{13 + i} w7"}
                                                       for i in range(4)])
    good = f"d={report / 'draft'}"
    cases = [
        (replay_argv(report, f"self={other}") + ["--target", other], ["made with the target", str(report / "target")]),
        (replay_argv(report, f"self={other}", outputs=copy_report(report, tmp_path / "old", older_report))
         + ["--target", other], ["made with the target"]),
        (replay_argv(report, good, prompts=renamed), [f"{renamed}:1", "'p0'", "not the prompt the report decoded"]),
        (replay_argv(report, good, prompts=partial), ["not in", "'p4', 'p5'"]),
        (replay_argv(report, good, outputs=copy_report(report, tmp_path / "oov", edit_row=out_of_vocabulary)),
         ["'p3'", "token id 1000", "64 tokens"]),
        (replay_argv(report, good, f"d={report / 'target'}"), ["'d'", "twice"]),
        (replay_argv(report, good) + ["--max-new-tokens", str(MAX_NEW + 6)], [f"--max-new-tokens {MAX_NEW + 6}",
                                                                            f"report's {MAX_NEW}"]),
    ]
    for argv, words in cases:
        before = snapshot(report)
        one_error_line(*cli(capsys, argv), *words)
        assert snapshot(report) == before


def test_replay_accepts_a_copy_of_the_target_and_the_prompts(report, tmp_path, capsys):
    """The check is by content: the same target in another directory, the same prompts in another file."""
    import shutil

    shutil.copytree(report / "target", tmp_path / "copy")
    shutil.copy(report / "p.jsonl", tmp_path / "q.jsonl")
    code, out, err = cli(capsys, replay_argv(report, f"self={tmp_path / 'copy'}", prompts=str(tmp_path / "q.jsonl"))
                         + ["--target", str(tmp_path / "copy"), "--max-new-tokens", str(MAX_NEW)])
    assert code == 0, err
    assert re.match(r"self: tau [\d.]+, acceptance 1\.000 ", out)


def test_eval_records_what_replay_checks(report):
    from drafttrain.evaluation.report import prompt_digest, target_fingerprint

    data = json.loads((report / "report" / "report.json").read_text())
    assert data["inputs"] == {"target": str((report / "target").resolve()),
                              "target_fingerprint": target_fingerprint(str(report / "target"))}
    assert target_fingerprint(str(report / "draft")) != data["inputs"]["target_fingerprint"]
    rows = [json.loads(line) for line in (report / "report" / "outputs.jsonl").read_text().splitlines()]
    tok = tiny_tokenizer(64)
    assert rows[0]["prompt_sha256"] == prompt_digest(tok("w5 w9 w13 w7")["input_ids"])


def test_replay_against_changed_weights_at_the_reports_path_names_the_fingerprint(report, tmp_path, capsys):
    """Issue 30: the report's target path, retrained in place, was refused as "made with the target
    X, not --target X": the same path twice. The path is the same; the weights' fingerprint is not."""
    changed = tmp_path / "tgt"
    save_pair(changed, tiny_lm(1, dtype=torch.float64), tiny_tokenizer(64))

    def at_changed_path(data):
        return {**data, "inputs": {**data["inputs"], "target": str(changed)}}

    outputs = copy_report(report, tmp_path / "r", at_changed_path)
    argv = replay_argv(report, f"d={report / 'draft'}", outputs=outputs) + ["--target", str(changed)]
    one_error_line(*cli(capsys, argv), str(changed), "fingerprint differs")


def test_eval_refuses_two_prompts_under_one_id_as_replay_would(report, tmp_path, capsys):
    """Issue 30 (G): eval passed a file with two lines of one id, and replay of its report then
    refused the very file it ran ("not the prompt the report decoded under that id"). Reports key
    outputs by id (as lm-eval's samples by doc id), so eval refuses the file up front, naming both
    lines, and nothing is written."""
    twice = write_jsonl(tmp_path / "twice.jsonl", [{"id": "a", "prompt": "w5 w9"}, {"id": "a", "prompt": "w7 w8"}])
    argv = ["eval", "--target", str(report / "target"), "--method", "ngram", "--prompts", twice, "--dtype", "float64",
            "--max-new-tokens", "4", "--out", str(tmp_path / "o"), "--quiet"]
    one_error_line(*cli(capsys, argv), f"{twice}:2", "'a'", f"{twice}:1", "\"id\"")
    assert not (tmp_path / "o").exists()
