"""`bench.md` and `bench.png` from the figures in `bench.json`."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _f(value, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def overhead_lines(o: dict | None) -> list[str]:
    """The step-overhead table (`bench.overhead`), or nothing where it was not run."""
    if not o:
        return []
    lines = ["", f"## Step overhead by drafter kind (tiny random models, K = {o['k']})", "",
             "What a drafter kind adds to every step whatever the model: host syncs per step (1 is the floor), "
             "ops run outside compiled steps (each a kernel launch from Python on a GPU), compiled calls (each one graph "
             "launch, a CUDA graph replay on a GPU) and the median step "
             "time with a 4-layer, 64-wide target (`drafttrain/bench/overhead.py`).", "",
             "| drafter | host syncs / step | eager ops / step | compiled calls / step | step ms (median) |",
             "|---|---|---|---|---|"]
    for r in o["rows"]:
        lines.append(f"| {r['drafter']} | {_f(r['syncs_per_step'], 2)} | {_f(r['eager_ops_per_step'], 1)} | "
                     f"{_f(r.get('compiled_calls_per_step'), 1)} | {_f(r['step_ms'], 2)} |")
    return lines


def capture_lines(c: dict | None) -> list[str]:
    """On CUDA, what CUDA graph trees did over the run's own compiled steps (`bench.capture`); off
    CUDA (nothing captured, both null) nothing."""
    if not c or c.get("cuda_graphs") is None:
        return []
    return [f"CUDA graph capture (drafttrain's compiled steps; transformers' own not counted): "
            f"**{c['cuda_graphs']}** CUDA graphs recorded, cudagraph_skips **{c['cudagraph_skips']}** "
            "(0: every compiled step ran as a CUDA graph).", ""]


def render_markdown(b: dict) -> str:
    m, bw = b["model"], b["bandwidth"]
    lines = [
        "# drafttrain bench", "",
        f"Target {m['name']} ({m['dtype']}, {m['parameters'] / 1e6:,.2f}M parameters, "
        f"{_bytes(m['read_per_step_bytes'])} read per decode step) on {b['environment']['device']}; "
        f"{b['config']['num_prompts']} prompts, {b['config']['max_new_tokens']} new tokens each, greedy, batch 1, "
        f"medians of {b['config']['repeats']} repeats. torch {b['environment']['torch']}, transformers "
        f"{b['environment']['transformers']}.", "",
        "## Roofline", "",
        f"Read bandwidth (a {bw['bytes'] / 2**20:,.0f} MiB on-device reduction): **{_bytes(bw['bytes_per_s'])}/s**. "
        f"Roofline (weight bytes read per step / bandwidth): **{_f(b['roofline_tokens_per_s'])} tok/s**.", "",
        "## Plain decoding", "",
        "| decoder | tok/s (median) | min – max | % of roofline | compile/capture s |",
        "|---|---|---|---|---|",
    ]
    for name, r in b["plain_decoding"].items():
        if "skipped" in r:
            lines.append(f"| {name} | – | – | – | skipped: {r['skipped']} |")
            continue
        t = r["tokens_per_s"]
        lines.append(f"| {name} | {_f(t['median'])} | {_f(t['min'])} – {_f(t['max'])} | "
                     f"{_f(100 * r['fraction_of_roofline'])} | {_f(r.get('compile_seconds'), 2)} |")
    lines += ["", "Our engines: decode steps only (each ends with its host sync). transformers: (N − 1) / "
              "(t(N) − t(1)) over `generate` calls of N and 1 new tokens, which also leaves prefill out. "
              "Compile/capture time is never part of tok/s.", ""]
    lines += capture_lines(b.get("capture"))
    if b["outputs"]:
        lines += [f"Greedy outputs of every engine equal the `{b['outputs']['reference']}` outputs: "
                  f"{_f(b['outputs']['all_equal'])} ({b['outputs']['detail']}).", ""]
    f = b["forward"]
    lines += [f"## One forward by number of tokens ({f['engine']} engine, after a {f['prompt_tokens']}-token "
              "prefix)", "", "| tokens | kind | ms (median) | × one token |", "|---|---|---|---|"]
    for r in f["rows"]:
        lines.append(f"| {r['tokens']} | {r['kind']} | {_f(1e3 * r['seconds']['median'], 3)} | "
                     f"{_f(r['ratio_to_one_token'], 2)} |")
    o = b["oracle"]
    lines += ["", f"## Oracle speculation ({o['engine']} engine, K = {o['k']})", "",
              "The oracle proposes the target's own greedy continuation, each token independently corrupted with "
              "probability 1 − α: per-token acceptance is α, Leviathan's model, with free proposals. Predicted "
              "speedup E(α, K) = (1 − α^(K+1)) / (1 − α); efficiency = measured / predicted. `with cost` divides "
              "E by the measured cost of a K+1-token forward relative to a 1-token one.", "",
              "| α | measured acceptance | tau | tok/s | measured speedup | predicted | efficiency | "
              "predicted with cost | output = plain |", "|---|---|---|---|---|---|---|---|---|"]
    for r in o["rows"]:
        lines.append(f"| {r['alpha']} | {_f(r['acceptance'], 3)} | {_f(r['tau'], 2)} | "
                     f"{_f(r['tokens_per_s']['median'])} | {_f(r['measured_speedup'], 2)} | "
                     f"{_f(r['predicted_speedup'], 2)} | {_f(r['efficiency'], 2)} | "
                     f"{_f(r['predicted_speedup_with_cost'], 2)} | {_f(r['outputs_match_plain'])} |")
    lines += overhead_lines(b.get("step_overhead"))
    if b["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in b["notes"]]
    lines += ["", "![bench](bench.png)", ""]
    return "\n".join(lines)


def plot(b: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    names = [n for n, r in b["plain_decoding"].items() if "tokens_per_s" in r]
    ax.bar(names, [b["plain_decoding"][n]["tokens_per_s"]["median"] for n in names], color="tab:blue")
    ax.axhline(b["roofline_tokens_per_s"], color="tab:red", linestyle="--", label="roofline")
    ax.set_ylabel("tokens/s")
    ax.set_title("plain decoding")
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend()
    ax = axes[1]
    chain = [r for r in b["forward"]["rows"] if r["kind"] == "chain"]
    ax.plot([r["tokens"] for r in chain], [1e3 * r["seconds"]["median"] for r in chain], marker="o", label="chain")
    for r in b["forward"]["rows"]:
        if r["kind"] == "tree":
            ax.plot([r["tokens"]], [1e3 * r["seconds"]["median"]], marker="s", linestyle="", label="Medusa tree")
    ax.set_xlabel("tokens in the forward")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title(f"one forward ({b['forward']['engine']})")
    ax.legend()
    ax = axes[2]
    rows = b["oracle"]["rows"]
    alphas = [r["alpha"] for r in rows]
    ax.plot(alphas, [r["predicted_speedup"] for r in rows], marker="o", label="predicted E(α, K)")
    ax.plot(alphas, [r["predicted_speedup_with_cost"] for r in rows], marker="^", label="predicted with cost")
    ax.plot(alphas, [r["measured_speedup"] for r in rows], marker="s", label="measured")
    ax.set_xlabel("α")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"oracle, K = {b['oracle']['k']}")
    ax.legend()
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(prefix=".bench.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
