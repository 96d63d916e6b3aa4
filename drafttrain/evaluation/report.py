"""Writing an acceptance report (SPEC §2): outputs.jsonl, report.json, report.md and its plots.

The report is written into a staging directory that `outputs.staged_output` swaps into place
when complete, so a failed or interrupted run never leaves a half-written report behind.
Figures are built as plain matplotlib `Figure` objects (no pyplot state), so tests can read
their titles and labels back.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..kinds.registry import REGISTRY
from .load import stops_paying_at
from .metrics import PromptResult, divergence

FINGERPRINT_BYTES = 1 << 20  # hashed from each end of a weights file: enough to tell two models apart, fast


def prompt_digest(ids: list[int]) -> str:
    """outputs.jsonl's `prompt_sha256`: the hash of a prompt's token ids, so `replay` can tell that
    it encodes the same prompt (content, tokenizer and chat template) the report decoded."""
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()


def target_fingerprint(path: str) -> str | None:
    """report.json's `inputs.target_fingerprint`: a hash of a local model directory's config and
    the sizes, head and tail of its weights files, so `replay` can tell outputs of another target
    from this one's (a copy elsewhere is the same target); None for a hub id."""
    return weights_fingerprint(path)


def weights_fingerprint(path: str, also: tuple[str, ...] = ()) -> str | None:
    """A hash of a local model directory: for each of its weights files (.safetensors, .bin),
    config.json and the files named in `also` (a drafter's `drafttrain.json`: the acceptance its
    export recorded), the name, the size and the first and last MiB. Enough to tell two models
    apart, and fast on a 1 GB checkpoint; a copy elsewhere hashes the same. None for a hub id."""
    root = Path(path)
    if not root.is_dir():
        return None
    digest = hashlib.sha256()
    for file in sorted(root.iterdir()):
        if file.name not in ("config.json", *also) and file.suffix not in (".safetensors", ".bin"):
            continue
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(f.read(FINGERPRINT_BYTES))
            if size > 2 * FINGERPRINT_BYTES:
                f.seek(-FINGERPRINT_BYTES, os.SEEK_END)
            digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()


def report_inputs(target: str) -> dict:
    """report.json's `inputs`: which target the report ran, for `replay` to check against."""
    local = Path(target).is_dir()
    return {"target": str(Path(target).resolve()) if local else target, "target_fingerprint": target_fingerprint(target)}


def output_rows(results: list[PromptResult], with_divergence: bool) -> list[dict]:
    """outputs.jsonl; `with_divergence` (greedy runs with a baseline) adds where each prompt's
    output first left the baseline's and the baseline's top-1 minus top-2 logit there."""
    rows = []
    for r in results:
        row = {
            "id": r.id,
            "category": r.category,
            "baseline_token_ids": r.baseline.tokens if r.baseline is not None else None,
            "speculative_token_ids": r.speculative.tokens,
            "accepted_lengths": r.speculative.accepted_lengths,
            "proposed_lengths": r.speculative.proposed_lengths,
        }
        if with_divergence:
            row["first_divergence"], row["divergence_margin"] = divergence(r)
        rows.append({**row, **r.extra})
    return rows


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|",
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]


def metrics_table(rows: dict[str, dict]) -> str:
    cols = [("prompts", "prompts"), ("new tokens", "new_tokens"), ("tau", "mean_accepted_length"),
            ("acceptance", "acceptance_rate"), ("draft forwards", "draft_forwards"),
            ("baseline tok/s", "baseline_tokens_per_s"),
            ("speculative tok/s", "speculative_tokens_per_s"), ("speedup", "speedup"),
            ("match baseline", "outputs_match_baseline")]
    lines = ["| | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, m in rows.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(m.get(key)) for _, key in cols) + " |")
    return "\n".join(lines)


def predicted_table(rows: dict[str, dict]) -> str:
    lines = ["| | alpha | E[tokens/step] | tau (measured) | cost ratio c | predicted speedup | measured speedup "
             "| efficiency |", "|---" * 8 + "|"]
    for name, m in rows.items():
        p = m.get("predicted")
        if p:
            lines.append(f"| {name} | {_fmt(p['alpha'])} | {_fmt(p['expected_tokens_per_step'])} | "
                         f"{_fmt(m['mean_accepted_length'])} | {_fmt(p['cost_ratio'])} | {_fmt(p['speedup'])} | "
                         f"{_fmt(m['speedup'])} | {_fmt(p['efficiency'])} |")
    return "\n".join(lines)


def categories_shown(report: dict) -> dict[str, dict]:
    """`overall` plus the categories, or `overall` alone when there is one category (the pair would
    repeat the same figures)."""
    by = report["by_category"]
    return {"overall": report["overall"], **(by if len(by) > 1 else {})}


# ----------------------------------------------------------------------------- figures


def subtitle(report: dict) -> str:
    """What every plot of a run says about the run: device, dtype, K, temperature, prompts."""
    cfg, env = report["config"], report["environment"]
    dtype = report.get("numerics", {}).get("dtype", cfg.get("dtype"))
    return (f"{env.get('device')}, {dtype}, K={cfg.get('num_draft_tokens')}, temperature {cfg.get('temperature')}, "
            f"{report['overall']['prompts']} prompts")


def _figure(width: float, height: float = 3.8):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def finished(fig, ax, title: str, subtitle_text: str, legend: bool = False):
    """Every line plot's last touches: a light grid, the legend, the title, the run's subtitle."""
    ax.grid(alpha=0.3)
    if legend:
        ax.legend()
    ax.set_title(title)
    fig.suptitle(subtitle_text, fontsize=8, y=0.995)
    fig.tight_layout()
    return fig


def per_position_figure(series: dict[str, list[float]], title: str, subtitle_text: str):
    """Fraction of verification steps that accepted draft position i, one line per series."""
    fig = _figure(6.4)
    ax = fig.add_subplot()
    longest = max((len(v) for v in series.values()), default=0)
    for name, values in series.items():
        if values:
            ax.plot(range(1, len(values) + 1), values, marker="o", label=name)
    ax.set_xticks(range(1, longest + 1))  # positions are whole numbers
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of steps accepted")
    ax.set_ylim(0, 1.05)
    return finished(fig, ax, title, subtitle_text, legend=True)


def bar_figure(values: dict[str, float | None], ylabel: str, title: str, subtitle_text: str,
               line: float | None = 1.0, digits: int = 3):
    """Bars with their values written on them (1.928 and 1.935 look alike otherwise)."""
    names = [k for k, v in values.items() if v is not None]
    fig = _figure(max(4.5, 1.3 * len(names) + 2.5))
    ax = fig.add_subplot()
    bars = ax.bar(names, [values[k] for k in names], color="tab:blue")
    ax.bar_label(bars, labels=[f"{values[k]:.{digits}f}" for k in names], padding=2, fontsize=8)
    if line is not None:
        ax.axhline(line, color="gray", linestyle="--", linewidth=1)
    ax.margins(y=0.15)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=20)
    fig.suptitle(subtitle_text, fontsize=8, y=0.995)
    fig.tight_layout()
    return fig


def scatter_figure(points: dict[str, tuple[float, float]], title: str, subtitle_text: str):
    """Measured tau against measured speedup, one labelled point per drafter."""
    fig = _figure(6.4)
    ax = fig.add_subplot()
    for name, (tau, speedup) in points.items():
        ax.scatter([tau], [speedup])
        ax.annotate(f"{name} ({tau:.3f}, {speedup:.2f}x)", (tau, speedup), textcoords="offset points",
                    xytext=(5, 5), fontsize=8)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("tau (mean accepted length)")
    ax.set_ylabel("measured speedup (×)")
    ax.margins(0.2)
    return finished(fig, ax, title, subtitle_text)


def window_figure(series: dict[str, list[dict]], title: str, subtitle_text: str):
    """tau against output position (`by_window`: each window at its middle), one line per series."""
    fig = _figure(6.4)
    ax = fig.add_subplot()
    for name, windows in series.items():
        if windows:
            ax.plot([(w["start"] + w["end"]) / 2 for w in windows], [w["tau"] for w in windows], marker="o",
                    label=name)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("output position (tokens; each point a window's middle)")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_ylim(bottom=0)
    return finished(fig, ax, title, subtitle_text, legend=True)


def load_figure(series: dict[str, list[dict]], title: str, subtitle_text: str):
    """Speedup against the target alone at each concurrency (`load`), one line per drafter."""
    fig = _figure(6.4)
    ax = fig.add_subplot()
    for name, load in series.items():
        points = [(e["concurrency"], e["speedup"]) for e in load if e["speedup"] is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xscale("log", base=2)
    levels = sorted({e["concurrency"] for load in series.values() for e in load})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("requests in flight (concurrency)")
    ax.set_ylabel("speedup (×) at that concurrency")
    return finished(fig, ax, title, subtitle_text, legend=True)


def save_figure(fig, path: Path) -> None:
    fig.savefig(path, dpi=110)


# Plain writes: a report is written into a staging directory that is swapped in whole.
def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_jsonl(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def report_figures(report: dict) -> dict[str, object]:
    """The plots of one drafter's report, by file name."""
    name, overall, by = report["drafter"], report["overall"], report["by_category"]
    sub = subtitle(report)
    figures = {}
    if overall["per_position_acceptance"]:
        series = {c: m["per_position_acceptance"] for c, m in categories_shown(report).items()}
        figures["per_position_acceptance.png"] = per_position_figure(series, f"Per-position acceptance: {name}", sub)
    if report.get("by_window") and overall["per_position_acceptance"]:  # plain decoding: tau 1 everywhere
        figures["tau_by_window.png"] = window_figure({name: report["by_window"]}, f"tau by output position: {name}",
                                                     sub)
    if report.get("load"):
        figures["load_speedup.png"] = load_figure({name: report["load"]}, f"Speedup under load: {name}", sub)
    if overall.get("speedup") is not None and len(by) > 1:
        figures["speedup_by_category.png"] = bar_figure(
            {c: m["speedup"] for c, m in categories_shown(report).items()}, "speedup (×)",
            f"Measured speedup by category: {name}", sub)
    return figures


# ----------------------------------------------------------------------------- markdown


def divergence_sentence(metrics: dict, numerics: dict) -> str | None:
    """The one sentence that tells rounding near-ties from decoder defects (greedy + baseline)."""
    diverged, near, n = metrics.get("divergences"), metrics.get("divergences_at_near_ties"), metrics["prompts"]
    if diverged is None:
        return None
    if diverged == 0:
        return f"All {n} greedy outputs equal the target alone's, token for token."
    tol, dtype = numerics.get("near_tie_tolerance"), numerics.get("dtype")
    text = (f"{diverged} of {n} greedy outputs differ from the target alone's; {near} of these divergences are at "
            f"near-ties (the target's top-1 minus top-2 logit at the first differing token is at most {tol} in "
            f"{dtype}), which come from different rounding of a k-token and a 1-token forward in low precision, "
            "not from the decoder")
    if diverged - near:
        text += (f", while the other {diverged - near} are not near-ties and point to a decoder defect (a `warning:` "
                 "line was printed for each; see `first_divergence` and `divergence_margin` in outputs.jsonl)")
    return text + "."


def render_markdown(report: dict, title: str = "Acceptance report") -> str:
    cfg, env, overall = report["config"], report["environment"], report["overall"]
    numerics, engine = report.get("numerics", {}), report.get("engine", {})
    lines = [
        f"# {title}: {report['drafter']}",
        "",
        f"Target `{cfg.get('target')}`, drafter `{report['drafter']}`, K={cfg.get('num_draft_tokens')}, "
        f"temperature {cfg.get('temperature')}, top-p {cfg.get('top_p')}, max new tokens "
        f"{cfg.get('max_new_tokens')}, {overall['prompts']} prompts, dtype {numerics.get('dtype', cfg.get('dtype'))}, "
        f"on {env.get('device')} (torch {env.get('torch')}, transformers {env.get('transformers')}).",
    ]
    if engine:
        capture = ""
        if engine.get("cuda_graphs") is not None:  # on CUDA: capture proven (every step a graph, no skip)
            capture = (f"; {engine['cuda_graphs']} CUDA graphs recorded, cudagraph_skips "
                       f"{engine.get('cudagraph_skips')}")
        lines += ["", f"Engine: {engine.get('used')} (requested {engine.get('requested')}); compile/capture "
                      f"{_fmt(engine.get('compile_seconds'), 1)} s (compile cache: {engine.get('compile_cache', 'off')}"
                      f"{capture}), not counted in tokens/s."]
    lines += [
        "",
        "tau = mean accepted length = new tokens / target forward passes (plain decoding: 1.0). "
        "Speedup = speculative tokens/s ÷ baseline tokens/s, both measured in this run on the same prompts.",
        "",
        *(line for kind in REGISTRY for line in kind.report_note(report)),
        "## Overall" + (" and by category" if len(report["by_category"]) > 1 else ""),
        "",
        metrics_table(categories_shown(report)),
        "",
    ]
    sentence = divergence_sentence(overall, numerics)
    if sentence:
        lines += [sentence, ""]
    if overall.get("predicted"):
        lines += [
            "## Predicted vs measured speedup",
            "",
            "alpha is the per-token acceptance probability of Leviathan et al. (2023), fitted so that the expected "
            "tokens per step (1 − α^(m+1))/(1 − α), averaged over this run's verification steps with each step's "
            "own number of drafts m, equals the measured tau. Predicted speedup = that expectation / (K·c + 1) with "
            "the measured draft/target cost ratio c (0 for n-gram lookup and heads); efficiency = measured / "
            "predicted speedup.",
            "",
            predicted_table(categories_shown(report)),
            "",
        ]
    lines += plan_section(report.get("plan"))
    lat_s, lat_b = overall.get("speculative_token_latency_ms"), overall.get("baseline_token_latency_ms")
    lines += ["## Per-token latency (ms)", "", "| | p50 | p90 | p99 |", "|---|---|---|---|"]
    for name, lat in (("speculative", lat_s), ("baseline", lat_b)):
        if lat:
            lines.append(f"| {name} | {_fmt(lat['p50'])} | {_fmt(lat['p90'])} | {_fmt(lat['p99'])} |")
    mem = overall.get("peak_memory_bytes")
    if mem:
        lines += ["", f"Peak memory: {mem / 2**20:.0f} MiB ({overall.get('peak_memory_kind')})."]
    figures = report_figures(report)
    ppa = overall["per_position_acceptance"]
    if ppa:
        lines += ["", "## Per-position acceptance", "",
                  "| position | " + " | ".join(str(i) for i in range(1, len(ppa) + 1)) + " |",
                  "|---" * (len(ppa) + 1) + "|",
                  "| accepted | " + " | ".join(_fmt(v) for v in ppa) + " |"]
        if "per_position_acceptance.png" in figures:
            lines += ["", "![per-position acceptance](per_position_acceptance.png)"]
    if "speedup_by_category.png" in figures:
        lines += ["", "## Speedup by category", "", "![speedup by category](speedup_by_category.png)"]
    lines += window_section(report, figures) + load_section(report, figures)
    return "\n".join(lines) + "\n"


def window_section(report: dict, figures: dict) -> list[str]:
    """Acceptance by output window (SPEC §9): does acceptance hold as the answer grows?"""
    windows = report.get("by_window")
    if windows is None:
        return []
    placed, prompts = report.get("by_window_prompts"), report["overall"]["prompts"]
    lines = ["", f"## Acceptance by output window ({report['config'].get('acceptance_window')} tokens)", "",
             "Each verification step counted in the window holding the first token it emitted; tau = tokens / steps "
             "there."]
    if placed is not None and placed < prompts:
        lines += ["", f"{prompts - placed} of {prompts} prompts are left out: vLLM records only the steps that "
                      "drafted, so where a lookup found nothing those steps cannot be placed in the output."]
    lines += [""] + markdown_table(
        ["tokens", "prompts", "steps", "tau", "acceptance", "per-position acceptance"],
        [[f"{w['start']}-{w['end']}", str(w["prompts"]), str(w["steps"]), _fmt(w["tau"]), _fmt(w["acceptance"]),
          " ".join(_fmt(v, 2) for v in w["per_position_acceptance"]) or "-"] for w in windows])
    if "tau_by_window.png" in figures:
        lines += ["", "![tau by output position](tau_by_window.png)"]
    return lines


def load_section(report: dict, figures: dict) -> list[str]:
    """Served concurrency (SPEC §9): the speedup at each number of requests in flight."""
    if not report.get("load"):
        return []
    stop = stops_paying_at(report["load"])
    verdict = (f"It stops paying at concurrency {stop}." if stop is not None
               else "It pays at every concurrency measured.")
    lines = ["", "## Under load (vLLM)", "",
             "Every prompt with N requests in flight in vLLM's engine, against the target alone at the same N in this "
             "run; tok/s = all output tokens / the wall time, tok/s per request = the mean of each request's. "
             f"{verdict}", ""]
    lines += markdown_table(
        ["concurrency", "tok/s", "tok/s per request", "target alone tok/s", "speedup", "tau", "match plain"],
        [[str(e["concurrency"]), _fmt(e["tokens_per_s"], 1), _fmt(e["tokens_per_s_per_request"], 1),
          _fmt(e["baseline_tokens_per_s"], 1), _fmt(e["speedup"], 2), _fmt(e["tau"]), _fmt(e["outputs_match_plain"], 2)]
         for e in report["load"]])
    if "load_speedup.png" in figures:
        lines += ["", "![speedup under load](load_speedup.png)"]
    return lines


def plan_section(plan: dict | None) -> list[str]:
    """The report's account of `--num-draft-tokens auto` / `--tree-nodes auto`: the costs measured,
    the settings weighed with their planned speedups, the one chosen, and how the plan compares
    with the measured speedup."""
    if not plan:
        return []
    if "num_draft_tokens" not in plan:  # only `--tree-nodes auto`, which did not apply to this drafter
        return ["## Plan (auto)", "", f"--tree-nodes auto did not apply: {plan['tree_nodes_auto_not_applicable']}.",
                ""]
    chosen = plan["num_draft_tokens"]
    tree = "verify_sizes" in plan["costs"]
    setting = f"K = {chosen}" + (f", {plan['tree_nodes']} nodes" if tree and chosen else "") + \
        (f", top-{plan['tree_topk']}" if plan.get("tree_topk") and chosen else "") + \
        (f", lookup {LOOKUP_MODE[plan['lookup_first']]}" if plan.get("lookup_first") is not None and chosen else "")
    hybrid = any(c.get("lookup_first") is not None for c in plan["candidates"])  # both modes weighed
    lines = ["## Plan (auto)", "",
             setting + (" (no speculation: the target alone)" if chosen == 0 else "")
             + f", planned speedup {_fmt(plan['planned_speedup'], 2)}, measured {_fmt(plan.get('measured_speedup'), 2)}. "
             f"Acceptance: {plan['source']}. {measured_when(plan)} " + (tree_costs_text(plan["costs"]) if tree else
                                                                          chain_costs_text(plan["costs"]))
             + " (model: `drafttrain.planning`).", ""]
    shown = plan["candidates"][:12] if tree else plan["candidates"]
    header = (["K", "nodes", "top-k"] if tree else ["K"]) + (["lookup"] if hybrid else [])
    lines += [f"| {' | '.join(header)} | expected tokens/step | planned speedup |",
              "|" + "---|" * (len(header) + 2)]
    for c in shown:
        mark = " (chosen)" if (c["num_draft_tokens"], c.get("tree_nodes"), c.get("tree_topk"), c.get("lookup_first")) == \
            (chosen, plan.get("tree_nodes"), plan.get("tree_topk") or c.get("tree_topk"), plan.get("lookup_first")) else ""
        cells = [f"{c['num_draft_tokens']}{mark}"] + ([_fmt(c.get("tree_nodes")), _fmt(c.get("tree_topk"))] if tree else [])
        cells += [LOOKUP_MODE.get(c.get("lookup_first"), "–")] if hybrid else []
        bound = "≤ " if c.get("measured") is False else ""
        lines.append(f"| {' | '.join(cells)} | {_fmt(c['expected_tokens'])} | {bound}{_fmt(c['planned_speedup'], 2)} |")
    if tree and len(plan["candidates"]) > len(shown):
        lines += ["", f"The {len(shown)} best of {len(plan['candidates'])} settings weighed (all: report.json `plan`)."]
    if tree:
        lines += ["", "≤: a tree not timed whole, planned at the least its step can cost (its verification and what "
                      "a measured tree no wider, deeper or smaller spent beyond it): the trees it could not beat "
                      "were not measured."]
    if plan.get("noise"):
        lines += ["", "**The cost measurement looked like a busy machine** (" + "; ".join(plan["noise"])
                  + "): the plan may be made from noise; measure alone."]
    return lines + [""]


LOOKUP_MODE = {True: "first", False: "beside"}  # a hybrid's mode in the plan's table (`decoding.hybrid`)


def measured_when(plan: dict) -> str:
    """Where the plan's measurements come from: this run, or the plan cache and when."""
    if plan.get("cached"):
        return (f"Costs and acceptance from the plan cache ($DRAFTTRAIN_HOME/plans), measured on this machine from "
                f"{plan.get('measured_at')} (`--replan` measures afresh; read in {_fmt(plan.get('seconds'), 1)} s):")
    return (f"Costs measured on this machine before timing ({_fmt(plan.get('seconds'), 1)} s of planning, not in "
            "tokens/s):")


def _ms(xs) -> str:
    return " / ".join(f"{x * 1e3:.1f}" for x in xs)


def chain_costs_text(costs: dict) -> str:
    return (f"target forward of 1 .. {len(costs['verify_seconds'])} tokens {_ms(costs['verify_seconds'])} ms; the "
            f"drafter's step for K = 0 .. {len(costs['draft_seconds']) - 1}: {_ms(costs['draft_seconds'])} ms; loop "
            f"overhead {costs['overhead_seconds'] * 1e3:.1f} ms a step")


def tree_costs_text(costs: dict) -> str:
    steps = "; ".join(f"K {s['num_draft_tokens']}, top-{s['tree_topk']}, {s['tree_nodes']} nodes: "
                      f"{s['seconds'] * 1e3:.1f}" for s in costs["step_seconds"])
    return (f"target verification of {', '.join(map(str, costs['verify_sizes']))} tree nodes "
            f"{_ms(costs['verify_seconds'])} ms; a plain step {costs['plain_step_seconds'] * 1e3:.1f} ms; whole steps "
            f"measured (ms): {steps}")




def write_report(out_dir: str | Path, report: dict, results: list[PromptResult]) -> None:
    """All files of one report into `out_dir`, a staging directory (`outputs.staged_output`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, fig in report_figures(report).items():
        save_figure(fig, out / name)
    with_divergence = report["overall"].get("divergences") is not None
    write_jsonl(out / "outputs.jsonl", output_rows(results, with_divergence))
    (out / "report.md").write_text(render_markdown(report))
    write_json(out / "report.json", report)
