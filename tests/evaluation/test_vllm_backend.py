"""`--backend vllm` without vLLM: settings mapped to vLLM's speculative_config, what vLLM cannot
serve as one error line, served steps counted as drafttrain counts them, and the whole served
path of eval and compare through a stand-in engine that answers as vLLM's does (the real engine:
test_vllm_served.py, where vLLM is installed)."""

import json
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch
from eval_helpers import cli, one_error_line
from tiny import greedy_reference, noisy_copy, save_pair, tiny_lm, tiny_tokenizer

from drafttrain.kinds.base import Drafter
from drafttrain.errors import UserError
from drafttrain.evaluation import vllm_backend
from drafttrain.evaluation.compare import parse_drafter, served_checks, served_warnings
from drafttrain.evaluation.config import EvalConfig
from drafttrain.evaluation.metrics import PromptResult, compute_metrics
from drafttrain.evaluation.run import Evaluation
from drafttrain.evaluation.vllm_backend import served_generation, speculative_config


def config(**kw):
    base = dict(target="T", prompts=["p.jsonl"], out="o", num_draft_tokens=4)
    return EvalConfig(**{**base, **kw})


def heads(n: int) -> Drafter:
    """Medusa heads as far as serving reads them: their count."""
    return Drafter("medusa", SimpleNamespace(config=SimpleNamespace(num_heads=n)))


def test_each_drafter_becomes_vllms_speculative_config():
    assert speculative_config(config(draft="D"), 4) == {"method": "draft_model", "model": "D",
                                                        "num_speculative_tokens": 4}
    parallel = Drafter("parallel_draft", None, {"pard_token": 9, "parallel_tokens": 4})
    assert speculative_config(config(draft="D"), 3, parallel) == {
        "method": "draft_model", "model": "D", "num_speculative_tokens": 3, "parallel_drafting": True}
    assert speculative_config(config(eagle3="E", tree="chain"), 4) == {"method": "eagle3", "model": "E",
                                                                      "num_speculative_tokens": 4}
    assert speculative_config(config(heads="H"), 3, heads(3)) == {"method": "medusa", "model": "H",
                                                                    "num_speculative_tokens": 3}
    assert speculative_config(config(method="ngram", ngram_max=5), 4) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 5}
    assert speculative_config(config(method="none"), 4) is None
    assert speculative_config(config(draft="D"), 0) is None  # the target alone: the served baseline


@pytest.mark.parametrize("kw, words", [
    (dict(draft="D", num_draft_tokens="auto"), ["--num-draft-tokens auto", "fixed K"]),
    (dict(draft="D", ngram=True), ["+ngram", "as one tree"]),
    (dict(heads="H", ngram=True), ["+ngram", "as one tree"]),
    (dict(eagle3="E", ngram=True), ["+ngram", "as one tree"]),
    (dict(eagle3="E", tree="dynamic"), ["--tree dynamic", "--tree chain"]),
    (dict(heads="H", tree="default"), ["--tree default", "chain"]),
])
def test_what_vllm_cannot_serve_is_refused_before_loading(kw, words):
    with pytest.raises(UserError) as e:
        config(backend="vllm", **kw).validate()
    for word in words:
        assert word in str(e.value)


def test_medusa_k_is_bounded_by_the_heads():
    with pytest.raises(UserError, match="--num-draft-tokens 3 or less"):
        speculative_config(config(heads="H"), 4, heads(3))


@dataclass
class Metrics:  # vLLM's RequestSpecDecodeMetrics, as much of it as is read
    per_step_accepted: list
    per_step_drafted: list


def test_served_steps_count_the_prefill_and_the_steps_that_drafted_nothing():
    # 12 tokens: token 1 from the prefill, drafting steps emitting 3, 1 and 5 tokens, and two
    # decode steps where n-gram lookup found nothing (one token each).
    gen = served_generation(list(range(12)), Metrics([2, 0, 4], [4, 4, 4]), None, forwards_per_step=1)
    assert sorted(gen.accepted_lengths) == [0, 0, 0, 0, 2, 4] and len(gen.proposed_lengths) == 6
    assert sum(gen.step_tokens) == 12 and gen.draft_forwards == 3
    m = compute_metrics([PromptResult("a", "c", gen, 1.0)], 4, True)
    assert m["mean_accepted_length"] == 12 / 6  # tokens per token-emitting target forward
    assert m["mean_acceptance_length"] == 1 + 6 / 3  # vLLM's own figure: drafting steps only
    assert m["per_position_acceptance_when_proposed"] == [2 / 3, 2 / 3, 1 / 3, 1 / 3]


def test_plain_served_decoding_is_one_token_a_step_and_margins_come_from_logprobs():
    lp = lambda x: SimpleNamespace(logprob=x)  # noqa: E731
    gen = served_generation([5, 6, 2], None, [{5: lp(-0.1), 7: lp(-2.6)}, {6: lp(-1.0), 8: lp(-1.0)}, {2: lp(0.0)}])
    assert gen.accepted_lengths == [0, 0, 0] and gen.step_tokens == [1, 1, 1]
    assert gen.margins == pytest.approx([2.5, 0.0, float("inf")])
    assert served_generation([], None, None).accepted_lengths == []


def test_ours_mean_acceptance_length_skips_steps_that_drafted_nothing():
    from drafttrain.decoding import Generation

    gen = Generation(tokens=list(range(8)), accepted_lengths=[1, 0, 3], proposed_lengths=[4, 0, 4],
                     step_tokens=[2, 1, 5])
    assert compute_metrics([PromptResult("a", "c", gen, 1.0)], 4, True)["mean_acceptance_length"] == 1 + 4 / 2


def test_compare_names_a_backend_per_drafter():
    assert parse_drafter("a=draft:/x@vllm") == ("a", {"draft": "/x", "backend": "vllm"})
    assert parse_drafter("a=ngram@drafttrain") == ("a", {"method": "ngram", "backend": "drafttrain"})
    assert parse_drafter("a=draft:/x@y") == ("a", {"draft": "/x@y"})  # an @ in a path stays
    with pytest.raises(UserError, match="@vllm"):
        parse_drafter("a=ngram@vllmm")


def evaluation(name, backend, tau, kind="draft", divergences=0, near=0):
    cfg = config(backend=backend, **({"draft": "D"} if kind == "draft" else {"method": kind}))
    overall = {"mean_acceptance_length": tau, "outputs_match_baseline": 1.0 - divergences / 4,
               "divergences": divergences, "divergences_at_near_ties": near}
    return Evaluation(cfg, {"drafter": name, "overall": overall}, [])


def test_served_checks_flag_a_tau_gap_beyond_3_percent_and_real_divergences():
    ok = served_checks([evaluation("d", "drafttrain", 2.0), evaluation("d@vllm", "vllm", 2.05)])
    assert [c["tau_flagged"] for c in ok] == [False] and served_warnings(ok) == []
    bad = served_checks([evaluation("d", "drafttrain", 2.0), evaluation("d@vllm", "vllm", 1.9, divergences=2, near=1)])
    assert bad[0]["relative_difference"] == pytest.approx(-0.05) and bad[0]["outputs_flagged"]
    lines = served_warnings(bad)
    assert len(lines) == 2 and all(line.startswith("warning: d@vllm:") for line in lines)
    assert "-5.0%" in lines[0] and "1 prompt(s)" in lines[1]
    ngram = served_warnings(served_checks([evaluation("n", "drafttrain", 1.5, "ngram"),
                                           evaluation("n@vllm", "vllm", 1.7, "ngram")]))
    assert len(ngram) == 1 and "earliest match" in ngram[0]
    assert served_checks([evaluation("d", "drafttrain", 2.0), evaluation("e", "vllm", 2.0, "ngram")]) == []


# ----------------------------------------------------------------------------- the served path


class StandInLLM:
    """Answers `generate` as vLLM's LLM does (token ids, per-step spec metrics, top-2 logprobs),
    from the target's own greedy output: plain decoding one token a step; with a drafter, the
    prefill's token then steps that accept all K drafts but the last step's."""

    def __init__(self, target, k):
        self.target, self.k = target, k
        self.llm_engine, self.generated = StandInEngine(self), []

    def generate(self, requests, params, use_tqdm=False):
        self.generated.append(requests[0]["prompt_token_ids"])
        return [SimpleNamespace(outputs=[self.answer(requests[0]["prompt_token_ids"], params)])]

    def answer(self, ids, params):
        tokens = greedy_reference(self.target, ids, params.max_tokens, eos=2)
        metrics = None
        if self.k:
            steps = [min(self.k + 1, len(tokens) - 1 - i) for i in range(0, len(tokens) - 1, self.k + 1)]
            metrics = Metrics([s - 1 for s in steps], [self.k] * len(steps))
        logprobs = None
        if params.logprobs:
            with torch.no_grad():
                logits = self.target(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1].log_softmax(-1)
            logprobs = [{int(i): SimpleNamespace(logprob=float(v)) for v, i in zip(*row.topk(2))} for row in logits]
        return SimpleNamespace(token_ids=tokens, spec_decode_metrics=metrics, logprobs=logprobs)


class StandInEngine:
    """`LLM.llm_engine` as `generate_concurrently` drives it: `add_request`, and `step` ending
    requests out of arrival order (request i after 1 + i % 3 steps); records how many requests
    were ever in flight at once and every prompt added."""

    def __init__(self, llm):
        self.llm, self.in_flight, self.added, self.most_in_flight = llm, {}, [], 0

    def add_request(self, request_id, prompt, params):
        assert params.output_kind == "final-only" and request_id not in self.in_flight
        index = int(request_id.rsplit("-", 1)[1])
        self.in_flight[request_id] = [prompt["prompt_token_ids"], params, 1 + index % 3]
        self.added.append(prompt["prompt_token_ids"])
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))

    def step(self):
        done = []
        for request_id, request in list(self.in_flight.items()):
            request[2] -= 1
            if request[2] == 0:
                del self.in_flight[request_id]
                done.append(SimpleNamespace(request_id=request_id, finished=True,
                                            outputs=[self.llm.answer(request[0], request[1])]))
        return done


class Started(list):
    """The specs of the engines started, in order; `llms`: the stand-in engines; `served`: the
    `ServedEngines` that started them."""

    def __init__(self):
        super().__init__()
        self.llms, self.served = [], []


@pytest.fixture
def stand_in(monkeypatch):
    started = Started()

    def start(self, key, *, target, dtype, device, seed, spec):
        from drafttrain.models import load_causal_lm

        started.append(spec)
        self.start_seconds[key] = 0.5
        self.sampling_params, self.final_only = SimpleNamespace, "final-only"
        started.served.append(self)
        llm = StandInLLM(load_causal_lm(target, torch.float64, torch.device("cpu"), "target"),
                         spec["num_speculative_tokens"] if spec else 0)
        started.llms.append(llm)
        return llm

    monkeypatch.setattr(vllm_backend, "vllm_version", lambda: "0.0-stand-in")
    monkeypatch.setattr(vllm_backend.ServedEngines, "_start", start)
    monkeypatch.setattr(vllm_backend.ServedDecoder, "settle_seconds", 0.0)  # no engine processes here
    return started


def test_a_timing_leaves_a_served_engine_time_to_go_quiet_and_does_not_count_it():
    """vLLM's engine core and worker poll busily for 1 s after a request, on the same cores: the
    next timed decode (ours or another engine's) waits that out, outside any timing."""
    import time

    from drafttrain.evaluation.costs import timed_generate

    assert vllm_backend.ServedDecoder.settle_seconds > 1.0  # vLLM 0.32 polls for 1 s

    class Quick:
        device = torch.device("cpu")
        settle_seconds = 0.3

        def generate(self, prompt, max_new):
            return prompt[:max_new]

    start = time.perf_counter()
    gen, seconds = timed_generate(Quick(), [1, 2, 3], 2)
    assert gen == [1, 2] and seconds < 0.3 <= time.perf_counter() - start
    Quick.settle_seconds = 0.0
    start = time.perf_counter()
    timed_generate(Quick(), [1], 1)
    assert time.perf_counter() - start < 0.3  # drafttrain's own decoders: nothing to wait for


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    tok = tiny_tokenizer(64)
    target = tiny_lm(0, dtype=torch.float64)
    save_pair(root / "target", target, tok)
    save_pair(root / "draft", noisy_copy(target), tok)
    (root / "p.jsonl").write_text("".join(json.dumps({"id": i, "prompt": " ".join(f"w{j}" for j in range(5 + i, 12 + i))})
                                          + "\n" for i in range(3)))
    return root


def test_compare_puts_served_rows_beside_ours(files, tmp_path, stand_in, capsys):
    out = tmp_path / "cmp"
    code, stdout, err = cli(capsys, [
        "compare", "--target", str(files / "target"), "--drafter", f"d=draft:{files / 'draft'}",
        "--drafter", f"d-served=draft:{files / 'draft'}@vllm", "--drafter", "n-served=ngram@vllm",
        "--prompts", str(files / "p.jsonl"), "--max-new-tokens", "10", "--num-draft-tokens", "3", "--dtype", "float64",
        "--out", str(out), "--quiet"])
    assert code == 0, err
    # One plain engine (the served rows' baseline) and one per served drafter, each started once.
    assert sorted(str(s and s["method"]) for s in stand_in) == ["None", "draft_model", "ngram"]
    reports = {n: json.loads((out / n / "report.json").read_text()) for n in ("d", "d-served", "n-served")}
    assert reports["d"]["backend"]["name"] == "drafttrain"
    served = reports["d-served"]
    assert served["backend"]["name"] == "vllm" and served["backend"]["version"] == "0.0-stand-in"
    assert served["backend"]["speculative_config"]["model"] == str(files / "draft")
    assert served["backend"]["engine_start_seconds"] == 0.5
    o = served["overall"]
    assert o["outputs_match_baseline"] == 1.0 and o["divergences"] == 0  # against the served plain decoding
    assert o["new_tokens"] == 30 and "predicted" not in o  # no prediction from drafttrain's costs
    # 10 tokens: the prefill's, then steps of 4, 4 and 1: every draft accepted but the last step's one.
    assert o["mean_acceptance_length"] == pytest.approx(1 + 6 / 3)
    assert o["target_forwards"] == 3 * 4 and o["draft_tokens"] == 3 * 9
    assert reports["d"]["overall"]["baseline_tokens_per_s"] != o["baseline_tokens_per_s"]  # each its own baseline
    comparison = json.loads((out / "comparison.json").read_text())
    assert [r["backend"] for r in comparison["drafters"]] == ["drafttrain", "vllm", "vllm"]
    (check,) = comparison["served_checks"]
    assert (check["drafttrain"], check["vllm"]) == ("d", "d-served")
    assert check["mean_acceptance_length"]["vllm"] == pytest.approx(3.0)
    assert "## Served acceptance" in (out / "comparison.md").read_text()
    outputs = [json.loads(line) for line in (out / "d-served" / "outputs.jsonl").read_text().splitlines()]
    ours = [json.loads(line) for line in (out / "d" / "outputs.jsonl").read_text().splitlines()]
    assert [r["speculative_token_ids"] for r in outputs] == [r["speculative_token_ids"] for r in ours]  # both lossless


def test_served_concurrency_runs_every_prompt_once_with_that_many_in_flight(files, tmp_path, stand_in, capsys):
    out = tmp_path / "load"
    code, stdout, err = cli(capsys, [
        "compare", "--target", str(files / "target"), "--drafter", f"d=draft:{files / 'draft'}@vllm",
        "--drafter", "n=ngram@vllm", "--prompts", str(files / "p.jsonl"), "--max-new-tokens", "10",
        "--num-draft-tokens", "3", "--dtype", "float64", "--concurrency", "3,1,2", "--out", str(out), "--quiet"])
    assert code == 0, err
    assert {e.max_num_seqs for e in stand_in.served} == {3}  # engines sized for the most in flight
    for llm in stand_in.llms:  # plain, draft, n-gram: every prompt once per concurrency above 1, in order
        prompts = llm.generated[-3:]  # one at a time: after a warm-up, each prompt once
        assert len({tuple(p) for p in prompts}) == 3
        assert llm.llm_engine.added == prompts + prompts
        assert llm.llm_engine.most_in_flight == 3 and not llm.llm_engine.in_flight
    for name in ("d", "n"):
        report = json.loads((out / name / "report.json").read_text())
        load = report["load"]
        assert [e["concurrency"] for e in load] == [1, 2, 3]
        one = report["overall"]
        assert load[0]["tokens_per_s"] == pytest.approx(one["speculative_tokens_per_s"])
        assert load[0]["baseline_tokens_per_s"] == pytest.approx(one["baseline_tokens_per_s"])
        for e in load:
            assert e["requests"] == 3 and e["output_tokens"] == one["new_tokens"]
            assert e["outputs_match_plain"] == 1.0  # greedy outputs as plain decoding's, at every concurrency
            assert e["speedup"] == pytest.approx(e["tokens_per_s"] / e["baseline_tokens_per_s"])
            assert e["tau"] == pytest.approx(one["mean_accepted_length"])  # the same steps, batched or not
        assert "## Under load (vLLM)" in (out / name / "report.md").read_text()
    md = (out / "comparison.md").read_text()
    assert "## Speedup under load (vLLM)" in md and "](load_speedup.png)" in md
    assert (out / "load_speedup.png").read_bytes()[:4] == b"\x89PNG"
    rows = json.loads((out / "comparison.json").read_text())["drafters"]
    assert all("stops_paying_at" in r for r in rows)


def test_load_entries_and_where_a_drafter_stops_paying():
    from drafttrain.decoding import Generation
    from drafttrain.evaluation.load import LoadRun, load_entry, stops_paying_at

    gens = [Generation(tokens=[1] * 8, accepted_lengths=[3, 3], proposed_lengths=[3, 3]), Generation(tokens=[1] * 4,
            accepted_lengths=[1, 1], proposed_lengths=[3, 3])]
    run = LoadRun(gens, [2.0, 1.0], 2.5)
    base = LoadRun([Generation(tokens=[1] * 8), Generation(tokens=[1] * 4)], [4.0, 2.0], 4.0)
    e = load_entry(4, run, base, [Generation(tokens=[1] * 8), Generation(tokens=[2] * 4)], greedy=True)
    assert e["tokens_per_s"] == pytest.approx(12 / 2.5) and e["baseline_tokens_per_s"] == pytest.approx(3.0)
    assert e["tokens_per_s_per_request"] == pytest.approx((8 / 2 + 4 / 1) / 2)
    assert e["speedup"] == pytest.approx(4.8 / 3.0) and e["tau"] == pytest.approx(12 / 4)
    assert e["outputs_match_plain"] == 0.5
    assert LoadRun.one_at_a_time(gens, [2.0, 1.0]).wall_seconds == 3.0
    assert stops_paying_at([{"concurrency": 1, "speedup": 1.4}, {"concurrency": 4, "speedup": 0.9},
                            {"concurrency": 16, "speedup": 0.7}]) == 4
    assert stops_paying_at([{"concurrency": 1, "speedup": 1.4}]) is None


def test_kv_cache_holds_every_sequence_in_flight():
    config = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2 in float32: 46 kB
    assert vllm_backend.kv_cache_bytes(config, torch.float32, 300, 1) == vllm_backend.KV_CACHE_BYTES
    assert vllm_backend.kv_cache_bytes(config, torch.float32, 2048, 16) == 2 * per_token * 2048 * 16


@pytest.mark.parametrize("argv, words", [
    (["--concurrency", "1,4"], ["--concurrency 1,4", "batch 1", "--backend vllm"]),
    (["--concurrency", "4,x"], ["--concurrency", "comma-separated"]),
    (["--concurrency", "0"], ["--concurrency", "at least 1"]),
    (["--concurrency", "2,2"], ["--concurrency", "once"]),
    (["--acceptance-window", "0"], ["--acceptance-window", "at least 1"]),
    (["--concurrency", "1,4", "--backend", "vllm"], ["--concurrency 4", "3 prompts", "at least 4 prompts"]),
])
def test_concurrency_on_the_bundled_decoder_and_bad_values_are_one_error_line(files, tmp_path, capsys, monkeypatch,
                                                                             argv, words):
    monkeypatch.setattr(vllm_backend, "vllm_version", lambda: "0.0-stand-in")
    out = tmp_path / "r"
    code, stdout, err = cli(capsys, ["eval", "--target", str(files / "target"), "--method", "ngram",
                                     "--prompts", str(files / "p.jsonl"), "--out", str(out), *argv])
    one_error_line(code, stdout, err, *words)
    assert not out.exists()


def test_eval_backend_vllm_without_vllm_is_one_error_line(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(vllm_backend, "vllm_version", lambda: None)
    out = tmp_path / "r"
    code, stdout, err = cli(capsys, ["eval", "--target", str(files / "target"), "--method", "ngram", "--backend", "vllm",
                                     "--prompts", str(files / "p.jsonl"), "--out", str(out)])
    one_error_line(code, stdout, err, "--backend vllm", "drafttrain[vllm]")
    assert not out.exists()


def test_only_the_backend_module_imports_vllm():
    """vLLM is an optional extra: two modules know it, each importing it lazily, the served
    backend (eval/compare --backend vllm) and the answer writer (data.generator: vllm)."""
    import ast
    from pathlib import Path

    import drafttrain

    def imports_vllm(path):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "vllm" or n.startswith("vllm.") for n in names):
                return True
        return False

    root = Path(drafttrain.__file__).parent
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if imports_vllm(p)) == [
        "data/vllm_answers.py", "evaluation/vllm_backend.py"]


def test_a_recipes_served_row_comes_from_vllm_or_not_at_all(monkeypatch, tmp_path):
    from drafttrain.prompts import EncodedPrompt
    from drafttrain.training import acceptance

    prompts = [EncodedPrompt(id="a", category="c", ids=[5, 6, 7])]
    kw = dict(num_draft_tokens=3, max_new_tokens=9, eos_token_ids={2}, dtype="float32")
    monkeypatch.setattr(vllm_backend, "vllm_version", lambda: None)
    assert acceptance.served_row(tmp_path, "draft", "T", prompts, **kw) is None  # no vLLM: the card is unchanged
    calls = []

    def serve(export, kind, target, ids, **kwargs):
        calls.append((export, kind, target, ids, kwargs["k"]))
        return [served_generation(list(range(9)), Metrics([3, 3], [3, 3]), None)]

    monkeypatch.setattr(vllm_backend, "vllm_version", lambda: "9.9")
    monkeypatch.setattr(vllm_backend, "serve_export", serve)
    row = acceptance.served_row(tmp_path, "draft", "T", prompts, **kw)
    assert calls == [(str(tmp_path), "draft", "T", [[5, 6, 7]], 3)]
    assert row["drafter"] == "served: vllm 9.9, chain of 3"
    assert row["tau"] == 9 / 3 and row["per_position_acceptance"] == [2 / 3, 2 / 3, 2 / 3]
