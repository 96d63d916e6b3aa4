"""Writing an acceptance report (SPEC §2): outputs.jsonl, report.json, report.md and its plots.

Everything is rendered in memory first and each file is renamed into place, so a failed run
never leaves a half-written report behind.
"""

from __future__ import annotations

from pathlib import Path

from .fileio import atomic_write_json, atomic_write_jsonl, atomic_write_text
from .metrics import PromptResult


def output_rows(results: list[PromptResult]) -> list[dict]:
    return [
        {
            "id": r.id,
            "category": r.category,
            "baseline_token_ids": r.baseline.tokens if r.baseline is not None else None,
            "speculative_token_ids": r.speculative.tokens,
            "accepted_lengths": r.speculative.accepted_lengths,
            "proposed_lengths": r.speculative.proposed_lengths,
            **r.extra,
        }
        for r in results
    ]


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def metrics_table(rows: dict[str, dict]) -> str:
    cols = [("prompts", "prompts"), ("new tokens", "new_tokens"), ("tau", "mean_accepted_length"),
            ("acceptance", "acceptance_rate"), ("baseline tok/s", "baseline_tokens_per_s"),
            ("speculative tok/s", "speculative_tokens_per_s"), ("speedup", "speedup"),
            ("match baseline", "outputs_match_baseline")]
    lines = ["| | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, m in rows.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(m.get(key)) for _, key in cols) + " |")
    return "\n".join(lines)


def plot_per_position(series: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, values in series.items():
        if values:
            ax.plot(range(1, len(values) + 1), values, marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of steps accepted")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Per-position acceptance")
    fig.tight_layout()
    _save_fig(fig, path)


def plot_bars(values: dict[str, float | None], path: Path, ylabel: str, title: str, line: float | None = 1.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k, v in values.items() if v is not None]
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(names) + 2), 3.5))
    ax.bar(names, [values[k] for k in names], color="tab:blue")
    if line is not None:
        ax.axhline(line, color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    _save_fig(fig, path)


def _save_fig(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def render_markdown(report: dict, title: str = "Acceptance report") -> str:
    cfg, env, overall = report["config"], report["environment"], report["overall"]
    proposer = cfg.get("draft") or cfg.get("heads") or cfg.get("method")
    lines = [
        f"# {title}",
        "",
        f"Target `{cfg.get('target')}`, drafter `{proposer}`, K={cfg.get('num_draft_tokens')}, "
        f"temperature {cfg.get('temperature')}, top-p {cfg.get('top_p')}, max new tokens "
        f"{cfg.get('max_new_tokens')}, dtype {cfg.get('dtype')}, on {env.get('device')} "
        f"(torch {env.get('torch')}, transformers {env.get('transformers')}).",
        "",
        "tau = mean accepted length = new tokens / target forward passes (plain decoding: 1.0). "
        "Speedup = speculative tokens/s ÷ baseline tokens/s, both measured in this run on the same prompts.",
        "",
        *_heads_note(report.get("heads")),
        "## Overall and by category",
        "",
        metrics_table({"overall": overall, **report["by_category"]}),
        "",
    ]
    pred = overall.get("predicted")
    if pred:
        lines += [
            "## Predicted vs measured speedup",
            "",
            f"Draft/target cost ratio c = {_fmt(pred['cost_ratio'])} (measured), acceptance alpha = "
            f"{_fmt(overall['acceptance_rate'])}: E[tokens/step] = (1 − α^(K+1))/(1 − α) = "
            f"{_fmt(pred['expected_tokens_per_step'])}, predicted speedup E/(Kc+1) = "
            f"{_fmt(pred['speedup'])}; measured {_fmt(overall['speedup'])}.",
            "",
        ]
    lat_s, lat_b = overall.get("speculative_token_latency_ms"), overall.get("baseline_token_latency_ms")
    lines += ["## Per-token latency (ms)", "", "| | p50 | p90 | p99 |", "|---|---|---|---|"]
    for name, lat in (("speculative", lat_s), ("baseline", lat_b)):
        if lat:
            lines.append(f"| {name} | {_fmt(lat['p50'])} | {_fmt(lat['p90'])} | {_fmt(lat['p99'])} |")
    mem = overall.get("peak_memory_bytes")
    if mem:
        lines += ["", f"Peak memory: {mem / 2**20:.0f} MiB ({overall.get('peak_memory_kind')})."]
    ppa = overall["per_position_acceptance"]
    if ppa:
        lines += ["", "## Per-position acceptance", "",
                  "| position | " + " | ".join(str(i) for i in range(1, len(ppa) + 1)) + " |",
                  "|---" * (len(ppa) + 1) + "|",
                  "| accepted | " + " | ".join(_fmt(v) for v in ppa) + " |", "",
                  "![per-position acceptance](per_position_acceptance.png)"]
    if overall.get("speedup") is not None:
        lines += ["", "## Speedup by category", "", "![speedup by category](speedup_by_category.png)"]
    return "\n".join(lines) + "\n"


def _heads_note(info: dict | None) -> list[str]:
    if not info:
        return []
    lines = [f"Medusa heads: {info.get('kind', 'medusa-1')}, trained on target `{info.get('target')}`."]
    if info.get("verifier"):
        lines.append(f"**The verifier is the adapted target** `{info['verifier']}` (Medusa-2: LoRA adapters were "
                     "trained jointly with the heads), not the original target; pass it as --target.")
    return lines + [""]


def write_report(out_dir: str | Path, report: dict, results: list[PromptResult]) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    overall = report["overall"]
    if overall["per_position_acceptance"]:
        series = {"overall": overall["per_position_acceptance"]}
        if len(report["by_category"]) > 1:
            series.update({c: m["per_position_acceptance"] for c, m in report["by_category"].items()})
        plot_per_position(series, out / "per_position_acceptance.png")
    if overall.get("speedup") is not None:
        plot_bars({"overall": overall["speedup"], **{c: m["speedup"] for c, m in report["by_category"].items()}},
                  out / "speedup_by_category.png", "speedup (×)", "Measured speedup by category")
    atomic_write_jsonl(out / "outputs.jsonl", output_rows(results))
    atomic_write_text(out / "report.md", render_markdown(report))
    atomic_write_json(out / "report.json", report)  # last: its presence means the report is whole
