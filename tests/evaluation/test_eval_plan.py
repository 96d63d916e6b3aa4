"""`--num-draft-tokens auto` end to end on tiny models: acceptance from a calibration file or
the export's record, never from the evaluated prompts; bad input is one error line; the plan's
K is the K that decodes, losslessly."""

import json
import shutil

import pytest
import torch
from eval_helpers import cli, one_error_line, write_jsonl
from tiny import noisy_copy, save_pair, tiny_lm, tiny_tokenizer

from drafttrain.cli import main
from drafttrain.evaluation.config import PLAN_MAX_K
from drafttrain.evaluation.calibration import CALIBRATION_PROMPTS, LOOKUP_CALIBRATION_PROMPTS
from drafttrain.kinds.medusa.export import save_medusa
from drafttrain.kinds.medusa.model import MedusaHeads

PROMPTS = [{"prompt": "w5 w9 w13 w7"}, {"prompt": "w40 w41 w40 w41"}]
CALIBRATION = [{"prompt": "w3 w4 w5 w6"}, {"prompt": "w30 w31 w30 w31"}, {"prompt": "w12 w13 w14"}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    target = tiny_lm(0, max_positions=64)
    tok = tiny_tokenizer()
    dirs = {"target": save_pair(root / "target", target, tok), "draft": save_pair(root / "draft", noisy_copy(target), tok),
            "prompts": write_jsonl(root / "p.jsonl", PROMPTS), "calibration": write_jsonl(root / "c.jsonl", CALIBRATION)}
    recorded = root / "recorded"
    shutil.copytree(dirs["draft"], recorded)
    (recorded / "drafttrain.json").write_text(json.dumps(
        {"held_out": {"prompts": 8, "num_draft_tokens": 3, "tau": 2.5, "per_position_acceptance": [0.8, 0.5, 0.2]}}))
    dirs["recorded"] = str(recorded)
    heads = MedusaHeads.from_target(target, num_heads=3, num_layers=1)
    save_medusa(heads, root / "heads", extra={"drafttrain": {"kind": "medusa-1", "target": "t"}})
    dirs["heads"] = str(root / "heads")
    dirs["short"] = write_jsonl(root / "short.jsonl", [{"prompt": "w3"}, {"prompt": "w30 w31"}])
    return dirs


def argv(setup, out, *extra, drafter=("--draft",)):
    return ["eval", "--target", setup["target"], *drafter, "--prompts", setup["prompts"], "--max-new-tokens", "12",
            "--dtype", "float64", "--num-draft-tokens", "auto", "--out", str(out), "--quiet", *extra]


def test_auto_without_an_acceptance_source_is_one_error_naming_calibration(setup, tmp_path, capsys):
    one_error_line(*cli(capsys, argv(setup, tmp_path / "o", drafter=("--draft", setup["draft"]))),
                   "--calibration-prompts", "drafttrain.json")
    assert not (tmp_path / "o").exists()


def test_calibration_is_refused_without_auto_and_on_the_evaluated_prompts(setup, tmp_path, capsys):
    line = argv(setup, tmp_path / "o", "--calibration-prompts", setup["prompts"], drafter=("--draft", setup["draft"]))
    one_error_line(*cli(capsys, line), "evaluated prompt file")
    fixed = [*line[:line.index("auto")], "3", *line[line.index("auto") + 1:]]
    fixed[fixed.index(setup["prompts"], fixed.index("--calibration-prompts"))] = setup["calibration"]
    one_error_line(*cli(capsys, fixed), "--num-draft-tokens auto")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("drafter", ["draft", "ngram"])
def test_a_calibrated_plan_decodes_with_its_k_and_equals_the_target(setup, tmp_path, drafter):
    spec = ("--draft", setup["draft"]) if drafter == "draft" else ("--method", "ngram")
    assert main(argv(setup, tmp_path / "o", "--calibration-prompts", setup["calibration"], drafter=spec)) == 0
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    plan = report["plan"]
    k = plan["num_draft_tokens"]
    assert 0 <= k <= PLAN_MAX_K and report["config"]["num_draft_tokens"] == k
    assert len(report["overall"]["per_position_acceptance"]) == k
    assert plan["source"].startswith("3 calibration prompts")
    assert len(plan["costs"]["verify_seconds"]) == PLAN_MAX_K + 1 and all(s > 0 for s in plan["costs"]["verify_seconds"])
    assert [c["num_draft_tokens"] for c in plan["candidates"]] == list(range(PLAN_MAX_K + 1))
    best = max(plan["candidates"], key=lambda c: c["planned_speedup"])
    assert plan["planned_speedup"] == pytest.approx(best["planned_speedup"])
    assert plan["measured_speedup"] == report["overall"]["speedup"]
    assert report["overall"]["outputs_match_baseline"] == 1.0
    if drafter == "ngram":  # planned with the acceptance walked at each K
        draft = plan["costs"]["draft_seconds"]  # the lookup's own host time (issue 30, K)
        assert draft[0] == 0.0 and all(s > 0 for s in draft[1:]) and plan["proposal_rates"] is not None
        walked = plan["walked"]
        assert sorted(walked, key=int) == [str(k) for k in range(1, PLAN_MAX_K + 1)]
        assert walked[str(PLAN_MAX_K)]["acceptance"] == pytest.approx(plan["acceptance"])  # the decode's own K
        for c in plan["candidates"][1:]:
            assert c["expected_tokens"] == pytest.approx(1 + sum(walked[str(c["num_draft_tokens"])]["acceptance"]))
    else:
        assert plan["walked"] is None


def test_compare_plans_lookups_under_tree_nodes_auto(setup, tmp_path):
    """The demo's K=auto line: compare with --num-draft-tokens auto --tree-nodes auto and n-gram
    and suffix lookup beside a tree drafter. A lookup's plan is walked over the calibration
    outputs, and the walk asked for decode settings with the tree's size still `auto`: refused,
    and the whole comparison died after its other drafters' plans (Gemma-3 demo, 2026-11-26)."""
    assert main(["compare", "--target", setup["target"], "--drafter", f"h=heads:{setup['heads']}",
                 "--drafter", "n=ngram", "--drafter", "s=suffix", "--prompts", setup["prompts"], "--max-new-tokens", "8",
                 "--num-draft-tokens", "auto", "--tree-nodes", "auto", "--calibration-prompts", setup["short"],
                 "--dtype", "float64", "--out", str(tmp_path / "c"), "--quiet"]) == 0
    for name in "ns":
        report = json.loads((tmp_path / "c" / name / "report.json").read_text())
        assert sorted(report["plan"]["walked"], key=int) == [str(k) for k in range(1, PLAN_MAX_K + 1)]
        assert report["overall"]["outputs_match_baseline"] == 1.0


def test_the_exports_record_is_the_acceptance_source(setup, tmp_path):
    assert main(argv(setup, tmp_path / "o", drafter=("--draft", setup["recorded"]))) == 0
    plan = json.loads((tmp_path / "o" / "report.json").read_text())["plan"]
    assert "drafttrain.json" in plan["source"] and plan["acceptance"] == [0.8, 0.5, 0.2]
    assert plan["num_draft_tokens"] <= 3 and len(plan["candidates"]) == 4


def test_a_damaged_record_is_one_error(setup, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(setup["recorded"], bad)
    (bad / "drafttrain.json").write_text("{\"held_out\": 3}")
    one_error_line(*cli(capsys, argv(setup, tmp_path / "o", drafter=("--draft", str(bad)))), "damaged", "re-export")


def test_a_hybrid_eval_is_lossless_and_names_its_tree(setup, tmp_path):
    line = [a for a in argv(setup, tmp_path / "o", "--ngram", drafter=("--draft", setup["draft"]))]
    line[line.index("auto")] = "3"
    assert main(line) == 0
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["drafter"] == "draft+ngram" and report["overall"]["tree"].startswith("model chain + n-gram")
    assert report["overall"]["outputs_match_baseline"] == 1.0


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_a_planned_chain_hybrid_weighs_its_modes_and_decodes_the_one_chosen(setup, tmp_path, mode):
    """A chain hybrid is walked at every K in the modes `--lookup-first` leaves to the plan (auto:
    both), costs measured as far as both chains side by side; the report says the mode chosen, and
    the decode runs it (its tree's name), losslessly."""
    assert main(argv(setup, tmp_path / "o", "--ngram", "--lookup-first", mode, "--calibration-prompts",
                     setup["calibration"], drafter=("--draft", setup["draft"]))) == 0
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    plan = report["plan"]
    assert len(plan["costs"]["verify_seconds"]) == 2 * PLAN_MAX_K + 1 and len(plan["lookup_seconds"]) == PLAN_MAX_K + 1
    modes = {"auto": [False, True], "on": [True], "off": [False]}[mode]
    walked = plan["walked_hybrid"]
    assert [(w["num_draft_tokens"], w["lookup_first"]) for w in walked] == [(k, f) for k in range(1, PLAN_MAX_K + 1)
                                                                            for f in modes]
    assert all(w["tokens_per_step"] >= 1 and 0 <= w["model_share"] <= 1 for w in walked)
    md = (tmp_path / "o" / "report.md").read_text()  # the plan's table says each setting's mode, and one is chosen
    assert "| K | lookup | expected tokens/step | planned speedup |" in md and md.count("(chosen)") == 1
    assert [c["lookup_first"] for c in plan["candidates"]] == [None] + [f for _ in range(PLAN_MAX_K) for f in modes]
    chosen = max(plan["candidates"], key=lambda c: c["planned_speedup"])
    assert (plan["num_draft_tokens"], plan["lookup_first"]) == (chosen["num_draft_tokens"], chosen["lookup_first"])
    if plan["num_draft_tokens"]:
        first = plan["lookup_first"]
        assert report["config"]["lookup_first"] == ("on" if first else "off")
        assert report["overall"]["tree"].startswith("n-gram chain" if first else "model chain + n-gram")
    assert report["overall"]["outputs_match_baseline"] == 1.0


@pytest.mark.parametrize("extra, words", [(("--ngram",), ["--draft DIR"]),
                                          (("--ngram", "--temperature", "0.5"), ["greedy"])])
def test_bad_hybrids_are_one_error(setup, tmp_path, capsys, extra, words):
    spec = ("--method", "ngram") if words == ["--draft DIR"] else ("--draft", setup["draft"])
    line = argv(setup, tmp_path / "o", *extra, drafter=spec)
    line[line.index("auto")] = "3"
    one_error_line(*cli(capsys, line), *words)


def test_compare_takes_plus_ngram_on_a_draft_only(setup, tmp_path, capsys):
    from drafttrain.evaluation.compare import parse_drafter

    assert parse_drafter(f"h=draft:{setup['draft']}+ngram") == ("h", {"draft": setup["draft"], "ngram": True})
    assert parse_drafter(f"d=draft:{setup['draft']}") == ("d", {"draft": setup["draft"]})
    code, out, err = cli(capsys, ["compare", "--target", setup["target"], "--drafter", "x=ngram+ngram",
                                  "--prompts", setup["prompts"], "--out", str(tmp_path / "c")])
    one_error_line(code, out, err, "NAME=draft:DIR+ngram")


def test_calibration_reads_prompts_until_its_interval_is_tight(setup, tmp_path):
    """Prompts are read one at a time until tokens a step is known to within the tolerance
    (`planning.enough_prompts`), at most LOOKUP_CALIBRATION_PROMPTS for n-gram lookup (its copying
    varies the most) and CALIBRATION_PROMPTS for a model. The reference: each calibration prompt
    decoded by the n-gram decoder itself at K = PLAN_MAX_K, on the target, its tokens a step
    counted until the interval is tight. One prompt repeated is known after the minimum."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafttrain.decoding import DecodeSettings
    from drafttrain.kinds.base import Drafter
    from drafttrain.kinds.factory import build_decoder
    from drafttrain.planning import MIN_CALIBRATION_PROMPTS, enough_prompts
    from drafttrain.prompts import encode_prompt, read_prompts

    varied = [{"id": f"c{i}", "prompt": " ".join(f"w{3 + (i * 7 + j * (i % 3 + 1)) % 50}" for j in range(4 + i % 5))}
              for i in range(LOOKUP_CALIBRATION_PROMPTS + 2)]
    files = {"varied": write_jsonl(tmp_path / "varied.jsonl", varied),
             "same": write_jsonl(tmp_path / "same.jsonl", [dict(CALIBRATION[1], id=f"s{i}") for i in range(30)])}
    target = AutoModelForCausalLM.from_pretrained(setup["target"], dtype=torch.float64)
    tokenizer = AutoTokenizer.from_pretrained(setup["target"])
    decoder = build_decoder(target, Drafter("ngram"), DecodeSettings(num_draft_tokens=PLAN_MAX_K,
                                                                      eos_token_ids=frozenset({2})))
    per_prompt = []
    for record in read_prompts([files["varied"]], LOOKUP_CALIBRATION_PROMPTS):
        gen = decoder.generate(encode_prompt(record, tokenizer), 12)
        per_prompt.append((len(gen.tokens), len(gen.accepted_lengths)))
        if enough_prompts(per_prompt):
            break
    expected = len(per_prompt)
    for name, spec, prompts, count in (("ngram", ("--method", "ngram"), "varied", expected),
                                       ("ngram", ("--method", "ngram"), "same", MIN_CALIBRATION_PROMPTS),
                                       ("draft", ("--draft", setup["draft"]), "same", MIN_CALIBRATION_PROMPTS)):
        out = tmp_path / f"{name}-{prompts}"
        assert main(argv(setup, out, "--calibration-prompts", files[prompts], drafter=spec)) == 0
        source = json.loads((out / "report.json").read_text())["plan"]["source"]
        assert source.startswith(f"{count} calibration prompts"), (name, prompts, source)
    assert CALIBRATION_PROMPTS < LOOKUP_CALIBRATION_PROMPTS


def test_calibration_prompts_are_compared_with_the_evaluated_ones_by_content(setup, tmp_path, capsys):
    """Issue 30 (H): a byte-identical copy of --prompts under another name planned on the evaluated
    prompts, since only paths were compared. SPEC §7 wants acceptance from other prompts, so any
    calibration prompt that is also evaluated is refused, with the count (lm-eval's decontamination
    reports overlap the same way: by content, counted), and nothing is written."""
    copy = write_jsonl(tmp_path / "copy.jsonl", PROMPTS)
    some = write_jsonl(tmp_path / "some.jsonl", [*CALIBRATION, {"id": "x", **PROMPTS[1]}])
    for calibration, count in ((copy, "2 of the 2"), (some, "1 of the 4")):
        line = argv(setup, tmp_path / "o", "--calibration-prompts", calibration, drafter=("--method", "ngram"))
        one_error_line(*cli(capsys, line), count, "evaluated prompt file", f"{setup['prompts']}:")
    assert not (tmp_path / "o").exists()


def test_a_missing_calibration_file_names_its_flag(setup, tmp_path, capsys):
    """Issue 30: a missing --calibration-prompts file was reported as "pass an existing JSONL file
    to --prompts", the flag that was right."""
    line = argv(setup, tmp_path / "o", "--calibration-prompts", str(tmp_path / "none.jsonl"),
                drafter=("--method", "ngram"))
    error = one_error_line(*cli(capsys, line), "none.jsonl", "--calibration-prompts")
    assert "--prompts" not in error.replace("--calibration-prompts", "")
    assert not (tmp_path / "o").exists()


BUDGETS = {  # (drafter flags, extra flags) that planned past caches sized for the run's own budget
    "ngram, 1 new token": (("--method", "ngram"), ("--max-new-tokens", "1")),
    "ngram, 2 new tokens": (("--method", "ngram"), ("--max-new-tokens", "2")),
    "draft LM, 1 new token": ("draft", ("--max-new-tokens", "1")),
    "heads' tree, 8 new tokens": ("heads", ("--max-new-tokens", "8", "--num-draft-tokens", "2", "--tree-nodes", "auto")),
}


@pytest.mark.parametrize("case", sorted(BUDGETS))
def test_a_plan_fits_any_budget_it_is_given(setup, tmp_path, case):
    """Issue 30 (A): with 1 or 2 new tokens (or a tree sized for 8), the plan's own probes decoded
    past KV caches sized for the run's budget: "the KV cache holds at most 14 tokens", for valid
    input that a fixed K ran. The caches now hold the probes too, with short calibration prompts."""
    spec, extra = BUDGETS[case]
    spec = ("--" + spec, setup[spec]) if isinstance(spec, str) else spec
    line = [*argv(setup, tmp_path / "o", "--calibration-prompts", setup["short"], drafter=spec), *extra]
    assert main(line) == 0
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["plan"]["num_draft_tokens"] >= 0 and report["overall"]["outputs_match_baseline"] == 1.0


def test_compare_plans_a_tree_and_says_tree_nodes_auto_did_not_apply_to_a_chain(setup, tmp_path):
    """Issue 30 (A, B): compare with heads and a chain draft under --tree-nodes auto: the heads'
    tree is planned within an 8-token budget, and the draft's report says --tree-nodes auto did not
    apply to it, rather than a plan of null (as `vllm bench` prints the settings each run used)."""
    assert main(["compare", "--target", setup["target"], "--drafter", f"h=heads:{setup['heads']}",
                 "--drafter", f"d=draft:{setup['draft']}", "--prompts", setup["prompts"], "--max-new-tokens", "8",
                 "--num-draft-tokens", "2", "--tree-nodes", "auto", "--calibration-prompts", setup["short"],
                 "--dtype", "float64", "--out", str(tmp_path / "c"), "--quiet"]) == 0
    heads = json.loads((tmp_path / "c" / "h" / "report.json").read_text())["plan"]
    draft = json.loads((tmp_path / "c" / "d" / "report.json").read_text())["plan"]
    assert heads["tree_nodes"] is None or heads["tree_nodes"] >= 2
    assert "drafts a chain" in draft["tree_nodes_auto_not_applicable"]
    assert "did not apply" in (tmp_path / "c" / "d" / "report.md").read_text()


@pytest.mark.parametrize("drafter, extra, words", [
    ("draft", (), ["--tree-nodes auto", "draft drafts a chain", "--num-draft-tokens auto"]),
    ("heads", ("--temperature", "0.5"), ["--tree-nodes auto", "when sampling"]),
    ("heads", ("--tree", "chain"), ["--tree-nodes auto", "--tree chain"])])
def test_tree_nodes_auto_for_a_drafter_without_a_tree_is_refused(setup, tmp_path, capsys, drafter, extra, words):
    """Issue 30 (B): --tree-nodes auto with a chain drafter (or a tree drafter that drafts a chain
    when sampling) exited 0 with a null plan, the calibration file silently unused. An `auto` that
    cannot apply is one error line, as lm-eval refuses arguments a task does not take."""
    line = argv(setup, tmp_path / "o", "--tree-nodes", "auto", "--calibration-prompts", setup["calibration"], *extra,
                drafter=(f"--{drafter}", setup[drafter]))
    line[line.index("auto")] = "2"
    one_error_line(*cli(capsys, line), *words)
    assert not (tmp_path / "o").exists()


def planned_with(setup, tmp_path, capsys, spec=("--method", "ngram"), prompts=None):
    """(report's plan, stderr) of a planned eval."""
    line = argv(setup, tmp_path / "o", "--calibration-prompts", setup["calibration"], drafter=spec)
    if prompts:
        line[line.index(setup["prompts"])] = prompts
    code, _, err = cli(capsys, line)
    assert code == 0, err
    return json.loads((tmp_path / "o" / "report.json").read_text())["plan"], err


@pytest.mark.parametrize("impossible", ["overhead", "draft forward"])
def test_costs_that_cannot_be_the_machines_fall_back_to_the_target_alone(setup, tmp_path, capsys, monkeypatch,
                                                                         impossible):
    """Issue 30 (J): on a shared machine the demo planned a draft at 1.21x that measured 0.62x, from
    a 2.15 s plain-step overhead and a 0.448 s draft forward beside a 39 ms target forward. Costs
    like that are measured again, and where they stay impossible the plan is the target alone
    (never slower than itself) with one warning, not speculation sized on noise."""
    from drafttrain.evaluation import plan as planner

    monkeypatch.setattr(planner, "ROUND_AGREEMENT", -1.0)  # every round measured: the count below is exact
    calls = []
    if impossible == "overhead":
        monkeypatch.setattr(planner, "loop_overhead", lambda *a, **k: calls.append(1) or 2.15)
    else:
        real = planner.model_drafter_seconds

        def slow(*args, **kwargs):
            calls.append(1)
            seconds, noise = real(*args, **kwargs)
            return [s + 0.448 * k for k, s in enumerate(seconds)], noise

        monkeypatch.setattr(planner, "model_drafter_seconds", slow)
    plan, err = planned_with(setup, tmp_path, capsys, spec=("--draft", setup["draft"]))
    assert plan["num_draft_tokens"] == 0 and plan["planned_speedup"] == 1.0 and plan["untrusted"]
    # measured again before giving up (the loop's overhead in a measurement's first round only)
    probes = len(plan["costs"]["context_lengths"])
    assert len(calls) == planner.COST_ATTEMPTS * probes * (1 if impossible == "overhead" else planner.COST_ROUNDS)
    warnings = [w for w in err.splitlines() if "cannot be the machine's" in w]
    assert len(warnings) == 1 and "target alone" in warnings[0], err


def test_the_loops_overhead_is_its_first_rounds_at_each_probe(setup, tmp_path, capsys, monkeypatch):
    """A plain decode a round timed the loop's overhead beyond a forward (0.7-1.0 s of each of
    Gemma-3's rounds on 2 cores, for 0 to 0.5 ms): the later rounds keep the first's, and the plan
    prices a step with it."""
    from drafttrain.evaluation import plan as planner

    monkeypatch.setattr(planner, "ROUND_AGREEMENT", -1.0)  # every round measured
    monkeypatch.setattr(planner, "settles", lambda *args: False)
    measured = []
    monkeypatch.setattr(planner, "loop_overhead", lambda *a, **k: measured.append(1e-4 * (len(measured) + 1)) or measured[-1])
    plan, _ = planned_with(setup, tmp_path, capsys)
    probes = len(plan["costs"]["context_lengths"])
    assert plan["costs"]["rounds"]["target"] == planner.COST_ROUNDS and len(measured) == probes
    assert plan["costs"]["overhead_seconds"] == pytest.approx(sum(measured) / probes)


def test_plausible_costs_are_trusted_and_measured_once(setup, tmp_path, capsys):
    plan, err = planned_with(setup, tmp_path, capsys, spec=("--draft", setup["draft"]))
    assert plan["untrusted"] == [] and "cannot be the machine's" not in err


def test_costs_are_measured_over_the_context_lengths_the_run_decodes(setup, tmp_path, capsys, monkeypatch):
    """Issue 30 (K): n-gram planned 1.10x on a mixed set (prompts of ~10 to ~850 tokens) and measured
    0.94x: its costs came from one probe prompt at one context length, and the lookup's own host
    time counted as zero. Costs are now measured mid-decode of each prompt-length bucket and
    averaged, and the lookup's time is a cost like a draft model's."""
    from drafttrain.evaluation import plan as planner

    lengths = []
    real = planner.forward_curve

    def recording(lm, prompt, *args, **kwargs):
        lengths.append(len(prompt))
        return real(lm, prompt, *args, **kwargs)

    monkeypatch.setattr(planner, "forward_curve", recording)
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "w5 w9"}, {"prompt": " ".join(["w7 w8 w9"] * 6)},
                                                   {"prompt": " ".join(f"w{3 + i}" for i in range(40))}])
    plan, _ = planned_with(setup, tmp_path, capsys, prompts=mixed)
    contexts = plan["costs"]["context_lengths"]
    assert contexts == [2 + 6, 18 + 6, 40 + 6]  # each bucket's prompt, halfway through its 12 new tokens
    rounds = plan["costs"]["rounds"]["target"]
    assert sorted(set(lengths)) == contexts and len(lengths) == rounds * len(contexts)
    assert planner.MIN_COST_ROUNDS <= rounds <= planner.COST_ROUNDS
    assert all(s > 0 for s in plan["costs"]["draft_seconds"][1:])  # the lookup's host time


@pytest.mark.parametrize("lengths,probes", [([150, 160, 170, 180, 190, 200], [180 + 48]),
                                            ([10, 12, 100, 110, 400, 420], [12 + 48, 110 + 48, 420 + 48])])
def test_prompts_alike_in_length_are_probed_once(lengths, probes):
    """Costs are taken mid-decode (96 new tokens) of each length bucket's middle prompt (here 160,
    180 and 200 tokens, or 12, 110 and 420); where those probes lie within `PROBE_SPAN` of each
    other, at the middle one only: a forward's cost hardly moves over such a span."""
    from drafttrain.evaluation.plan import cost_probes
    from drafttrain.prompts import EncodedPrompt

    prompts = [EncodedPrompt(i, "c", list(range(3, 3 + n))) for i, n in enumerate(lengths)]
    found = cost_probes(prompts, 96)
    assert [len(p) for p in found] == probes
    assert all(any(p[:len(q.ids)] == q.ids for q in prompts) for p in found)  # each continues a prompt of the run


def injected_costs(monkeypatch, spread: float) -> list[str]:
    """Every chain cost timed as a machine whose every other measurement runs `spread` slower (0: a
    quiet one): what is timed, in order."""
    from drafttrain.evaluation import plan as planner

    timed = []

    def factor() -> float:
        timed.append(1)
        return 1 + spread * (len(timed) % 2)

    def target_round(cfg, models, ids, layers, sizes, overhead=None):
        f = factor()
        return [[0.010 * (1 + 0.1 * n) * f] * 3 for n in range(sizes)], 0.001 * f if overhead is None else overhead

    def drafter_seconds(cfg, models, ids, acceptance, max_k):
        f = factor()
        return [0.0] + [1e-4 * k * f for k in range(1, max_k + 1)], []

    monkeypatch.setattr(planner, "target_round", target_round)
    monkeypatch.setattr(planner, "drafter_seconds", drafter_seconds)
    return timed


@pytest.mark.parametrize("spread, settled, target, drafter", [(0.0, None, 2, 2), (0.02, None, 2, 2), (0.3, True, 2, 3),
                                                              (0.3, False, 3, 3)])
def test_a_quiet_machines_costs_take_two_rounds_and_a_noisy_ones_three(setup, tmp_path, capsys, monkeypatch, spread,
                                                                        settled, target, drafter):
    """Two rounds whose medians agree within `ROUND_AGREEMENT` measured a quiet machine: a third
    could not move a cost by more than they differ, and the plan is not asked. Where they disagree,
    the third is measured: the drafter's, and the target's unless its rounds settle the plan
    (`settles`, tested on its own below)."""
    from drafttrain.evaluation import plan as planner

    timed = injected_costs(monkeypatch, spread)
    asked = []
    real = planner.settles
    monkeypatch.setattr(planner, "settles", lambda *args: asked.append(1) or (real(*args) if settled is None else settled))
    plan, _ = planned_with(setup, tmp_path, capsys)
    probes = len(plan["costs"]["context_lengths"])
    assert plan["costs"]["rounds"] == {"target": target, "drafter": drafter}
    assert len(timed) == (target + drafter) * probes and planner.ROUND_AGREEMENT == 0.05
    assert bool(asked) == (settled is not None)


def test_a_third_target_round_only_where_either_round_alone_plans_otherwise():
    """`settles`: the target's rounds settle a plan where each round alone makes the plan both make.
    A round slower at every size plans as the other; one where verifying 3 tokens got dearer than
    the 2 extra tokens pay for plans K = 1 where the other plans K = 2 (the reference: `plan_chain`
    on each round's costs, worked by hand below)."""
    from drafttrain.evaluation import plan as planner
    from drafttrain.planning import plan_chain

    def round_(verify: list[float]) -> list:
        return [([[t] * 3 for t in verify], 0.0)]  # one probe: 3 timings a size, no overhead

    drafter = [[([0.0, 0.0, 0.0], [])]]  # a free drafter, K = 0 .. 2
    acceptance = [0.9, 0.9]  # tokens a step: K = 1 1.9, K = 2 2.71

    def decide(costs):
        return plan_chain(acceptance, costs).num_draft_tokens

    fast, slow = round_([0.010, 0.011, 0.012]), round_([0.020, 0.022, 0.024])
    # K = 2: 2.71 / 0.012 beats K = 1: 1.9 / 0.011, in either round and in both
    assert planner.settles(decide, [fast, slow], drafter, 1)
    dear = round_([0.010, 0.011, 0.020])  # K = 2: 2.71 / 0.020 = 135.5 a second; K = 1: 1.9 / 0.011 = 172.7
    assert decide(planner.chain_costs([dear], drafter, 1)) == 1 and decide(planner.chain_costs([fast], drafter, 1)) == 2
    assert not planner.settles(decide, [fast, dear], drafter, 1)
    # both rounds' costs: each the median of their six timings (0.012 and 0.020 -> 0.016 for 3 tokens)
    assert planner.chain_costs([fast, dear], drafter, 1).verify == pytest.approx((0.010, 0.011, 0.016))


def test_rounds_agree_within_the_tolerance_of_every_cost():
    """`agreeing`: every cost's round medians, each within 5% of their median; one cost apart is enough for a third."""
    from drafttrain.evaluation import plan as planner

    assert planner.agreeing([[1.0, 1.04], [0.0, 0.0], [2.0, 2.0]])
    assert not planner.agreeing([[1.0, 1.04], [1.0, 1.06]])
    quiet = planner.interleaved_rounds(lambda r: 1.0 + 0.01 * r, lambda rounds: [rounds])
    noisy = planner.interleaved_rounds(lambda r: 1.0 + 0.2 * r, lambda rounds: [rounds])
    assert quiet == [1.0, 1.01] and noisy == [1.0, 1.2, 1.4]
    target = [[([[0.010, 0.011, 0.012]], 0.001)], [([[0.0101, 0.0109, 0.0121]], 0.002)]]  # [round][probe]
    series = planner.target_series(target)  # a one-token forward's round medians, and a plain step's
    assert series == [[0.011, 0.0109], [pytest.approx(0.012), pytest.approx(0.0129)]]


def test_a_planned_tree_hybrid_weighs_every_tree_in_both_modes(setup, tmp_path):
    """A tree hybrid (Medusa heads + n-gram) under --tree-nodes auto: every tree weighed beside the
    lookup and lookup first, read off one recording, and the run lossless. (These untrained heads plan
    the target alone; the chosen mode reaching the decoder is checked on the chain hybrid above, a
    lookup-first tree's decoding in tests/decoding/test_hybrid.py.)"""
    assert main(argv(setup, tmp_path / "o", "--ngram", "--tree-nodes", "auto", "--calibration-prompts",
                     setup["calibration"], drafter=("--heads", setup["heads"]))) == 0
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    trees = [c for c in report["plan"]["candidates"] if c["num_draft_tokens"]]
    both = {(c["num_draft_tokens"], c["tree_nodes"], c["tree_topk"]) for c in trees if c["lookup_first"] is False}
    first = {(c["num_draft_tokens"], c["tree_nodes"], c["tree_topk"]) for c in trees if c["lookup_first"] is True}
    assert both and both == first and len(trees) == 2 * len(both)
    assert report["overall"]["outputs_match_baseline"] == 1.0


def test_plans_keep_the_targets_prefills_and_the_evaluation_decodes_without(setup, tmp_path, monkeypatch):
    """A plan's whole steps and forward curves all start from the same probe: the target keeps its
    prefills while planning (`CachedLM.keeping_prefills`), and only then; the evaluation's decodes,
    whose prefills are part of what a run measures, compute theirs."""
    from drafttrain.evaluation import plan as planner
    from drafttrain.evaluation import run

    kept = {"plan": [], "evaluation": []}

    def spy(where, module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            target = args[0].target if where == "evaluation" else args[1].target_lm
            kept[where].append(target.kept is not None)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    spy("plan", planner, "tree_step_seconds")
    spy("evaluation", run, "timed_generate")
    assert main(argv(setup, tmp_path / "o", "--tree-nodes", "auto", "--calibration-prompts", setup["calibration"],
                     drafter=("--heads", setup["heads"]))) == 0
    assert kept["plan"] and all(kept["plan"])
    assert kept["evaluation"] and not any(kept["evaluation"])


def test_a_tree_hybrids_steps_are_timed_without_its_lookup_and_shared_with_its_models_plan(setup, tmp_path,
                                                                                           monkeypatch):
    """A tree hybrid's whole steps are its model's alone (`planning.tree_seconds` adds the lookup's
    nodes as calibration counted them): timed without the lookup, under the model's own cache entries,
    so a hybrid planned after its model measures no step the model's plan measured. Every tree step is
    priced as if its verification were free here, so each plan measures its leaders."""
    from drafttrain import planning
    from drafttrain.evaluation import plan as planner

    timed = []
    real = planner.tree_step_seconds

    def spy(cfg, models, ids, depth, nodes, topk):
        timed.append((cfg.hybrid, depth, nodes, topk))
        return real(cfg, models, ids, depth, nodes, topk)

    monkeypatch.setattr(planner, "tree_step_seconds", spy)
    monkeypatch.setattr(planning.TreeCosts, "least_verify_seconds", lambda self, nodes: 1e-9)
    runs = {}
    for name, extra in (("model", ()), ("hybrid", ("--ngram",))):
        timed.clear()
        assert main(argv(setup, tmp_path / name, *extra, "--tree-nodes", "auto", "--calibration-prompts",
                         setup["calibration"], drafter=("--heads", setup["heads"]))) == 0
        runs[name] = [t for t in timed if t[1]]  # whole tree steps (depth 0: the plain step)
        report = json.loads((tmp_path / name / "report.json").read_text())
        assert report["overall"]["outputs_match_baseline"] == 1.0
    assert runs["model"] and all(hybrid is None for hybrid, *_ in runs["model"] + runs["hybrid"])
    assert not set(runs["model"]) & set(runs["hybrid"])
