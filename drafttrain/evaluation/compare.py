"""`drafttrain compare`: several drafters, one target, one process, one shared baseline.

This is how the demo shows how a trained drafter stands against its starting point and n-gram
lookup: every figure in the comparison comes from the same run on the same prompts. The output
directory holds comparison.md/json, the comparison plots and one full report per drafter.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import UserError
from ..kinds.registry import BY_NAME, flagged, methods
from .config import BACKEND_CHOICES, EvalConfig, _or, drafter_fields, lookups, shared_settings
from .outputs import REPORT_MARKERS, prepare_output_dir, staged_output
from .load import stops_paying_at
from .report import (_fmt, bar_figure, load_figure, markdown_table, per_position_figure, save_figure, scatter_figure,
                     subtitle, window_figure, write_json, write_report)
from .run import DecoderFactory, Evaluation, check_inputs, evaluate

FIGURE_CAPTIONS = {"tau.png": "tau by drafter", "per_position_acceptance.png": "per-position acceptance by drafter",
                   "speedup.png": "speedup by drafter", "tau_vs_speedup.png": "tau vs speedup",
                   "tau_by_window.png": "tau by output position", "load_speedup.png": "speedup under load"}
# Every name compare writes into --out beside the drafters' folders: a drafter may not take one.
COMPARISON_FILES = ("comparison.md", "comparison.json", *FIGURE_CAPTIONS)
# Nor a name that makes --out read as another report: the files drafttrain knows a report directory
# by (`outputs.REPORT_MARKERS`: a folder `report.json` beside comparison.json) and those `replay`
# reads from one (outputs.jsonl, with the report.json beside it).
RESERVED_NAMES = tuple(dict.fromkeys((*COMPARISON_FILES, *REPORT_MARKERS, "report.md", "outputs.jsonl")))
NAME_MAX = 255  # bytes in one file name on Linux and macOS file systems


def drafter_forms() -> str:
    """The forms of --drafter, from the registry, for its error message."""
    paths = [f"NAME={k.flag}:DIR" for k in flagged()]
    joined = [f"+{k.name}" for k in lookups()]
    first = ", ".join(f"{p}{joined[0]}" for p in paths)
    return (f"use {_or(paths)} (each may end in {joined[0]}: {first}" + "".join(f"; or {j}" for j in joined[1:])
            + f"), {_or([f'NAME={k.name}' for k in methods()])}, each optionally ending in @vllm or @drafttrain")


def parse_drafter(arg: str) -> tuple[str, dict]:
    """`NAME=FLAG:DIR` for a drafter with weights (`NAME=draft:DIR`, `NAME=heads:DIR`,
    `NAME=eagle3:DIR`) or `NAME=METHOD` (`NAME=ngram`, `NAME=suffix`, `NAME=none`); a drafter with
    weights may end in `+LOOKUP` (`+ngram`: the lookup's chain verified as one more branch of its
    chain or tree), and any drafter in `@vllm` or `@drafttrain` (who decodes it; unset: --backend).
    Returns the settings that differ from --drafter to --drafter (`EvalConfig` fields)."""
    name, sep, what = arg.partition("=")
    head, at, backend = what.rpartition("@")
    at = bool(at) and backend in BACKEND_CHOICES
    what = head if at else what
    flags = {k.flag for k in flagged()}
    hybrid = next((k.name for k in lookups() if what.endswith(f"+{k.name}") and what.partition(":")[0] in flags), None)
    kind, _, path = what.removesuffix(f"+{hybrid}").partition(":") if hybrid else what.partition(":")
    if not sep or not name or kind not in flags | {k.name for k in methods()} or (kind in flags) != bool(path):
        raise UserError(f"--drafter {arg!r} is malformed; {drafter_forms()}")
    check_drafter_name(name, arg)
    fields = {kind: path, **({hybrid: True} if hybrid else {})} if kind in flags else {"method": kind}
    return name, {**fields, **({"backend": backend} if at else {})}


def check_drafter_name(name: str, arg: str) -> None:
    """NAME becomes the drafter's report folder in --out: checked before any decoding, so a name
    the file system refuses, or one that is also a file compare writes, cannot fail the run at
    its very end, and one a report is read by (`RESERVED_NAMES`) cannot make --out pass for
    another report. Compared without case, for case-insensitive file systems."""
    if "/" in name or "\\" in name or "\0" in name or name.startswith("."):
        raise UserError(f"--drafter {arg!r}: NAME names the drafter's report folder, so it cannot contain '/', "
                        "'\\' or a NUL character, or start with '.'; choose another NAME")
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        raise UserError(f"--drafter {arg[:40]!r}...: NAME names the drafter's report folder and is longer than "
                        f"{NAME_MAX} bytes; choose a shorter NAME")
    clash = next((f for f in RESERVED_NAMES if f.casefold() == name.casefold()), None)
    if clash:
        what = "compare also writes" if clash in COMPARISON_FILES else "drafttrain reads a report's"
        raise UserError(f"--drafter {arg!r}: NAME names the drafter's report folder, but {what} {clash} in --out; "
                        f"choose another NAME (not one of {', '.join(RESERVED_NAMES)})")


def drafter_configs(base: EvalConfig, drafters: list[str]) -> list[EvalConfig]:
    """One config per `--drafter`, each reporting into `base.out/NAME`."""
    parsed = [parse_drafter(d) for d in drafters]
    names = [n for n, _ in parsed]
    if len(set(names)) != len(names):
        raise UserError("drafter names must be unique; give each --drafter its own NAME")
    unset = {field: setting.default for field, (_, setting) in drafter_fields().items()}
    return [replace(base, **{**unset, **fields}, name=name,
                    out=str(Path(base.out) / name)) for name, fields in parsed]


def comparison_rows(evaluations: list[Evaluation]) -> list[dict]:
    rows = []
    for e in evaluations:
        o = e.report["overall"]
        p = o.get("predicted") or {}
        plan = e.report.get("plan") or {}
        rows.append({"drafter": e.report["drafter"], "backend": e.report["backend"]["name"],
                     "num_draft_tokens": e.report["config"]["num_draft_tokens"],
                     "planned_speedup": plan.get("planned_speedup"), "tau": o["mean_accepted_length"],
                     "acceptance_rate": o["acceptance_rate"], "alpha": p.get("alpha"),
                     "speculative_tokens_per_s": o["speculative_tokens_per_s"],
                     "baseline_tokens_per_s": o["baseline_tokens_per_s"], "speedup": o["speedup"],
                     "predicted_speedup": p.get("speedup"), "efficiency": p.get("efficiency"),
                     "outputs_match_baseline": o["outputs_match_baseline"], "divergences": o["divergences"],
                     "divergences_at_near_ties": o["divergences_at_near_ties"],
                     "per_position_acceptance": o["per_position_acceptance"],
                     "mean_acceptance_length": o["mean_acceptance_length"],
                     "per_position_acceptance_when_proposed": o["per_position_acceptance_when_proposed"],
                     "by_window": e.report.get("by_window") or [], "load": e.report.get("load"),
                     "stops_paying_at": stops_paying_at(e.report.get("load"))})
    return rows


SERVED_TAU_TOLERANCE = 0.03  # issue 20: a served tau more than 3% from ours is flagged


def drafter_identity(cfg: EvalConfig) -> tuple:
    return cfg.drafter_kind, cfg.drafter_path or cfg.method, cfg.hybrid, cfg.num_draft_tokens, cfg.tree


def served_checks(evaluations: list[Evaluation]) -> list[dict]:
    """Each drafter run by both backends: vLLM's mean acceptance length (1 + accepted drafts per
    drafting step, counted alike for both) against drafttrain's, flagged beyond 3%, and whether
    vLLM's speculative outputs left its own plain decoding anywhere but at a near-tie."""
    ours = {drafter_identity(e.cfg): e for e in evaluations if e.cfg.backend == "drafttrain"}
    checks = []
    for e in evaluations:
        mine = ours.get(drafter_identity(e.cfg)) if e.cfg.backend == "vllm" else None
        if mine is None:
            continue
        a, b = mine.report["overall"], e.report["overall"]
        ta, tb = a["mean_acceptance_length"], b["mean_acceptance_length"]
        difference = (tb - ta) / ta if ta and tb is not None else None
        defects = b["divergences"] - (b["divergences_at_near_ties"] or 0) if b["divergences"] is not None else None
        checks.append({"drafttrain": mine.report["drafter"], "vllm": e.report["drafter"], "kind": e.cfg.drafter_kind,
                       "mean_acceptance_length": {"drafttrain": ta, "vllm": tb}, "relative_difference": difference,
                       "tau_flagged": difference is not None and abs(difference) > SERVED_TAU_TOLERANCE,
                       "served_outputs_match_served_plain": b["outputs_match_baseline"],
                       "served_divergences_not_near_ties": defects,
                       "outputs_flagged": bool(defects)})
    return checks


def served_section(checks: list[dict]) -> list[str]:
    """comparison.md's side-by-side of each drafter that both backends ran."""
    if not checks:
        return []
    lines = ["", "## Served acceptance", "",
             "Mean acceptance length counted as vLLM counts it (1 + accepted drafts per step that drafted) for "
             f"both; flagged beyond {100 * SERVED_TAU_TOLERANCE:.0f}%. vLLM's prefill emits token 1, which it never "
             "drafts; drafttrain's first step may accept a draft of it.", ""]
    lines += markdown_table(
        ["drafttrain", "vllm", "mean acceptance length (drafttrain / vllm)", "difference", "served = served plain",
         "flagged"],
        [[c["drafttrain"], c["vllm"], f"{_fmt(c['mean_acceptance_length']['drafttrain'], 3)} / "
          f"{_fmt(c['mean_acceptance_length']['vllm'], 3)}",
          "-" if c["relative_difference"] is None else f"{100 * c['relative_difference']:+.1f}%",
          _fmt(c["served_outputs_match_served_plain"], 2),
          ", ".join(x for x, f in (("tau", c["tau_flagged"]), ("outputs", c["outputs_flagged"])) if f) or "no"]
         for c in checks])
    return lines


def served_warnings(checks: list[dict]) -> list[str]:
    """One `warning:` line per flagged served check."""
    lines = []
    for c in checks:
        t, kind = c["mean_acceptance_length"], BY_NAME[c["kind"]]
        if c["tau_flagged"] and kind.served_note:  # a lookup: vLLM's own, not an export, explains it
            lines.append(f"warning: {c['vllm']}: vLLM's {kind.label} mean acceptance length {t['vllm']:.3f} is "
                         f"{100 * c['relative_difference']:+.1f}% from drafttrain's {t['drafttrain']:.3f}: "
                         f"{kind.served_note}")
        elif c["tau_flagged"]:
            lines.append(f"warning: {c['vllm']}: vLLM's mean acceptance length {t['vllm']:.3f} is "
                         f"{100 * c['relative_difference']:+.1f}% from drafttrain's {t['drafttrain']:.3f} "
                         f"({c['drafttrain']}), beyond {100 * SERVED_TAU_TOLERANCE:.0f}%: the export may not serve as "
                         "trained (a weight name, the aux layers, the dtype); see its report")
        if c["outputs_flagged"]:
            lines.append(f"warning: {c['vllm']}: vLLM's speculative greedy outputs left its own plain decoding at "
                         f"{c['served_divergences_not_near_ties']} prompt(s) where the target is not near a tie")
    return lines


def comparison_figures(rows: list[dict], sub: str) -> dict[str, object]:
    """The comparison's plots, by file name."""
    figures = {"tau.png": bar_figure({r["drafter"]: r["tau"] for r in rows}, "tau (mean accepted length)",
                                     "Mean accepted length by drafter", sub)}
    if any(r["per_position_acceptance"] for r in rows):
        figures["per_position_acceptance.png"] = per_position_figure(
            {r["drafter"]: r["per_position_acceptance"] for r in rows if r["per_position_acceptance"]},
            "Per-position acceptance by drafter", sub)
    if any(r["speedup"] is not None for r in rows):
        figures["speedup.png"] = bar_figure({r["drafter"]: r["speedup"] for r in rows}, "speedup (×)",
                                            "Measured speedup by drafter", sub, digits=2)
        figures["tau_vs_speedup.png"] = scatter_figure(
            {r["drafter"]: (r["tau"], r["speedup"]) for r in rows if r["speedup"] is not None},
            "tau vs measured speedup", sub)
    if any(r["by_window"] for r in rows):
        figures["tau_by_window.png"] = window_figure({r["drafter"]: r["by_window"] for r in rows},
                                                     "tau by output position", sub)
    if any(r["load"] for r in rows):
        figures["load_speedup.png"] = load_figure({r["drafter"]: r["load"] for r in rows if r["load"]},
                                                  "Speedup under load (vLLM)", sub)
    return figures


def window_table(rows: list[dict], window: int) -> list[str]:
    """comparison.md's tau per output window, a row per drafter."""
    starts = sorted({w["start"] for r in rows for w in r["by_window"]})
    if not starts:
        return []
    lines = ["", f"## tau by output window ({window} tokens)", ""]
    return lines + markdown_table(
        ["drafter", *(f"{s}-{s + window}" for s in starts)],
        [[r["drafter"], *(_fmt(next((w["tau"] for w in r["by_window"] if w["start"] == s), None)) for s in starts)]
         for r in rows])


def load_table(rows: list[dict]) -> list[str]:
    """comparison.md's speedup per concurrency of the served drafters, and where each stops paying."""
    served = [r for r in rows if r["load"]]
    if not served:
        return []
    levels = [e["concurrency"] for e in served[0]["load"]]
    lines = ["", "## Speedup under load (vLLM)", "",
             "Every prompt with N requests in flight in vLLM's engine, against the target alone at the same N in this "
             "run (tokens/s over the wall time of all requests).", ""]
    return lines + markdown_table(
        ["drafter", *(f"concurrency {c}" for c in levels), "stops paying at"],
        [[r["drafter"], *(_fmt(e["speedup"], 2) for e in r["load"]),
          "pays at every one" if r["stops_paying_at"] is None else str(r["stops_paying_at"])] for r in served])


# (column, row key, digits) of the comparison table
COMPARISON_COLUMNS = [("drafter", "drafter", None), ("K", "num_draft_tokens", None), ("tau", "tau", 3), ("acceptance", "acceptance_rate", 3),
                      ("alpha", "alpha", 3), ("tok/s", "speculative_tokens_per_s", 1),
                      ("baseline tok/s", "baseline_tokens_per_s", 1), ("speedup", "speedup", 2),
                      ("predicted", "predicted_speedup", 2), ("efficiency", "efficiency", 2),
                      ("match baseline", "outputs_match_baseline", 2)]
PLAN_COLUMN = ("planned (auto)", "planned_speedup", 2)  # with --num-draft-tokens auto
BACKEND_COLUMN = ("backend", "backend", None)  # with served rows


def render_comparison(rows: list[dict], first: dict, figures: dict, checks: list[dict] = ()) -> str:
    cfg, env = first["config"], first["environment"]
    planned = any(r["planned_speedup"] is not None for r in rows)
    k = "K planned per drafter (--num-draft-tokens auto)" if planned else f"K={cfg['num_draft_tokens']}"
    facts = [f"Target `{cfg['target']}`", f"{len(rows)} drafters", k,
             f"temperature {cfg['temperature']}", f"max new tokens {cfg['max_new_tokens']}",
             f"{first['overall']['prompts']} prompts from {', '.join(cfg['prompts'])} (limit {cfg['limit']})",
             f"dtype {first['numerics']['dtype']}", f"on {env['device']}"]
    lines = ["# Drafter comparison", "",
             ", ".join(facts) + ". One process: each prompt is decoded by the target alone, then by every drafter; "
             "speedups share that baseline. Predicted speedup and efficiency: see each drafter's report.", ""]
    served = any(r["backend"] == "vllm" for r in rows)
    columns = (COMPARISON_COLUMNS[:1] + [BACKEND_COLUMN] * served + COMPARISON_COLUMNS[1:8] + [PLAN_COLUMN] * planned
               + COMPARISON_COLUMNS[8:])
    lines += markdown_table([c for c, _, _ in columns],
                            [[r["drafter"], *(_fmt(r[key], digits) for _, key, digits in columns[1:])] for r in rows])
    diverged = [r for r in rows if r["divergences"]]
    if diverged:
        num = first["numerics"]
        lines += ["", "Greedy divergences from the target alone (near-ties: top-1 minus top-2 logit at most "
                      f"{num['near_tie_tolerance']} in {num['dtype']}, from different rounding of a k-token and a "
                      "1-token forward in low precision, not from the decoder): "
                  + "; ".join(f"{r['drafter']} {r['divergences_at_near_ties']} of {r['divergences']} at near-ties"
                              for r in diverged) + "."]
    if served:
        lines += ["", "Served rows (backend vllm) run in vLLM's offline engine, one prompt at a time; their baseline "
                      "is vLLM's own plain decoding of the same prompts, their match column compares with it."]
    lines += served_section(checks)
    lines += load_table(rows) + window_table(rows, cfg.get("acceptance_window"))
    for name in figures:
        lines += ["", f"![{FIGURE_CAPTIONS[name]}]({name})"]
    lines += ["", "Each drafter's full report: `<drafter>/report.md`."]
    return "\n".join(lines) + "\n"


def run_compare(base: EvalConfig, drafters: list[str], progress: bool = True,
                decoder_factory: DecoderFactory | None = None) -> list[Evaluation]:
    """`drafttrain compare`: check everything, run every drafter, write the comparison into base.out
    (replacing an earlier one whole only with base.overwrite)."""

    cfgs = drafter_configs(base, drafters)
    check_inputs(cfgs)
    prepare_output_dir(base.out, base.overwrite)
    evaluations = evaluate(cfgs, progress=progress, decoder_factory=decoder_factory)
    rows = comparison_rows(evaluations)
    checks = served_checks(evaluations)
    first = evaluations[0].report
    figures = comparison_figures(rows, subtitle(first))
    with staged_output(base.out, base.overwrite) as stage:
        for e in evaluations:
            write_report(stage / e.report["drafter"], e.report, e.results)
        for name, fig in figures.items():
            save_figure(fig, stage / name)
        (stage / "comparison.md").write_text(render_comparison(rows, first, figures, checks))
        write_json(stage / "comparison.json", {"drafters": rows, "config": {**shared_settings(base), "out": base.out},
                                               "environment": first["environment"], "numerics": first["numerics"],
                                               "engine": first["engine"], "served_checks": checks})
    return evaluations
