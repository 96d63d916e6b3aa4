"""`drafttrain replay`: greedy acceptance of draft models from ONE forward pass over the target's
own output, which any greedy report's outputs.jsonl already holds.

Under greedy verification a draft token is accepted iff it equals the target's greedy token, and
after an acceptance the draft continues from exactly the target's prefix. So the draft's argmax
at every position of (prompt + the target's greedy output) decides every step of chain
speculative decoding: the accepted and proposed lengths follow by replaying the decoder's step
rule (`ChainDecoder.generate`, drafts past an EOS that ended the output not counted).
Seconds instead of minutes per draft, which makes comparing many candidate drafts (layer
choices, checkpoints) cheap. It measures acceptance only: timings need `eval` or `compare`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..config import check_settings, flag_name, setting
from ..decoding import NUM_DRAFT_TOKENS, Generation
from ..kinds.registry import REGISTRY, Drafter, DrafterKind, kind_of
from ..errors import UserError
from ..models import load_causal_lm, load_tokenizer, resolve_device, resolve_dtype
from ..prompts import encode_prompt, read_prompts
from .config import DTYPE_CHOICES
from .windows import ACCEPTANCE_WINDOW, acceptance_by_window


def chain_steps(matches: list[bool] | list[list[bool]], num_draft_tokens: int, max_new_tokens: int,
                ended_at_eos: bool) -> tuple[list[int], list[int]]:
    """(accepted, proposed) draft tokens per verification step over the target's len(matches)
    output tokens. `matches[i]`: whether a draft LM's greedy token at output position i equals
    the target's (its guess there does not depend on where the step began); or, for EAGLE-3,
    whose draft j of a step is unroll step j, a list: `matches[t][j]` for the step that begins at
    output position t (empty where that step cannot draft).

    Mirrors the decoder: K' = min(K, tokens left - 1) drafts per step, the accepted prefix plus one
    target token emitted, nothing past the end. When the output ended at an EOS, the last step's
    drafts past that EOS were never in play and are not counted as proposed."""
    grid = bool(matches) and isinstance(matches[0], list)
    accepted, proposed, t, n = [], [], 0, len(matches)
    while t < n:
        k = min(num_draft_tokens, max_new_tokens - t - 1, len(matches[t]) if grid else num_draft_tokens)
        a = 0
        while a < k and t + a < n and (matches[t][a] if grid else matches[t + a]):
            a += 1
        emitted = min(a + 1, n - t)
        accepted.append(min(a, emitted))
        proposed.append(min(k, emitted) if ended_at_eos and t + emitted == n else k)
        t += emitted
    return accepted, proposed


def chain_accepted_lengths(matches: list[bool], num_draft_tokens: int, max_new_tokens: int) -> list[int]:
    """The accepted lengths of `chain_steps`."""
    return chain_steps(matches, num_draft_tokens, max_new_tokens, ended_at_eos=False)[0]


def teacher_forced_steps(drafter: Drafter, prompt: list[int], target_tokens: list[int], *, num_draft_tokens: int,
                         max_new_tokens: int, target=None) -> tuple[list[int], list[int]]:
    """(accepted, proposed) lengths of greedy chain decoding with `drafter`, where `target_tokens`
    is the target's greedy output for `prompt` (e.g. `baseline_token_ids` of outputs.jsonl): its
    kind's matches (`DrafterKind.replay_matches`; an EAGLE-3 draft reads the `target`'s features)."""
    ended_at_eos = len(target_tokens) < max_new_tokens
    matches = kind_of(drafter.kind).replay_matches(drafter, target, prompt, target_tokens, num_draft_tokens)
    return chain_steps(matches, num_draft_tokens, max_new_tokens, ended_at_eos)


def teacher_forced_accepted_lengths(drafter: Drafter, prompt: list[int], target_tokens: list[int], *,
                                    num_draft_tokens: int, max_new_tokens: int, target=None) -> list[int]:
    return teacher_forced_steps(drafter, prompt, target_tokens, num_draft_tokens=num_draft_tokens,
                                max_new_tokens=max_new_tokens, target=target)[0]


def tau(num_tokens: int, accepted_lengths: list[int]) -> float:
    """Mean accepted length as reports define it: new tokens per verification step (a step that
    ends at EOS can emit fewer than accepted + 1 tokens, so this is not the mean of accepted + 1)."""
    return num_tokens / max(len(accepted_lengths), 1)


# ----------------------------------------------------------------------------- the command


def replayed_kinds() -> dict[str, DrafterKind]:
    """The kinds `replay` scores, by their `--draft` prefix ("" for the default kind: NAME=DIR)."""
    return {("" if kind.replay_default else kind.flag): kind for kind in REGISTRY
            if kind.supports("replay_matches") and kind.flag}


def replay_spellings() -> str:
    """NAME=DIR or NAME=FLAG:DIR, one per replayed kind, each with the eval flag that reads that export."""
    return " or ".join(f"NAME={prefix + ':' if prefix else ''}DIR (--{kind.flag})"
                       for prefix, kind in replayed_kinds().items())


@dataclass(kw_only=True)
class ReplayConfig:
    """Greedy acceptance of drafts replayed over a report's target outputs."""

    target: str = setting(doc="The target the report ran (its tokenizer encodes the prompts).", metavar="T")
    prompts: list[str] = setting(doc="The prompt file(s) the report ran (SPEC §1); repeat for several.",
                                 metavar="FILE")
    outputs: str = setting(doc="A greedy report's outputs.jsonl (REPORT/outputs.jsonl).", metavar="FILE")
    draft: list[str] = setting(doc=f"An export to replay, as eval reads it: {replay_spellings()}; repeat for several.",
                               metavar="NAME=DIR")
    num_draft_tokens: int = setting(NUM_DRAFT_TOKENS, "K: draft tokens per verification step.", metavar="K",
                                    at_least=1)
    max_new_tokens: int | None = setting(None, "The report's --max-new-tokens (unset: read from the report.json "
                                         "beside --outputs).", metavar="N")
    acceptance_window: int = setting(ACCEPTANCE_WINDOW, "Output tokens per window of the acceptance by output "
                                     "position printed for each draft (as eval's by_window).", metavar="N",
                                     at_least=1)
    dtype: str = setting("auto", "The drafts' dtype; auto is bfloat16 on CUDA, float32 on CPU.",
                         choices=DTYPE_CHOICES)
    device: str = setting("auto", "auto, cpu, cuda or cuda:N.")
    plot: str | None = setting(None, "Also draw tau by output window into this PNG: one line per --draft and one for "
                               "the report's own drafter (its by_window).", metavar="PNG")
    overwrite: bool = setting(False, "Replace an existing --plot.")
    quiet: bool = setting(False, "No progress bar.")


@dataclass
class ReplayResult:
    """One draft's replay: per prompt, the output length and the per-step lengths."""

    name: str
    num_draft_tokens: int
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    accepted: list[list[int]] = field(default_factory=list)
    proposed: list[list[int]] = field(default_factory=list)
    by_window: list[dict] = field(default_factory=list)  # `windows.acceptance_by_window` of the replayed steps

    @property
    def tau(self) -> float:
        return tau(sum(self.tokens), [a for acc in self.accepted for a in acc])

    @property
    def per_prompt_tau(self) -> list[float]:
        return [tau(n, acc) for n, acc in zip(self.tokens, self.accepted)]

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(sum(p) for p in self.proposed)
        return sum(sum(a) for a in self.accepted) / drafted if drafted else 0.0


@dataclass
class ReportOutputs:
    """A greedy report's outputs.jsonl, by prompt id, and the report.json beside it ({} when none)."""

    tokens: dict[str, list[int]]
    digests: dict[str, str]  # prompt id -> `prompt_sha256` (reports that record it)
    report: dict
    path: str

    @property
    def config(self) -> dict:
        config = self.report.get("config")
        return config if isinstance(config, dict) else {}


def read_outputs(path: str) -> ReportOutputs:
    """outputs.jsonl and the report.json beside it, each line checked: an id and a list of token ids."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"--outputs {path}: no such file; pass a report's outputs.jsonl")
    report = read_report_json(file.with_name("report.json"))
    result = ReportOutputs({}, {}, report, path)
    if result.config.get("temperature", 0) != 0:
        raise UserError(f"{path} comes from a sampled run (temperature {result.config['temperature']}); replay "
                        "needs a greedy report (--temperature 0)")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--outputs {path}: cannot read it ({e}); pass a report's outputs.jsonl") from e
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            _read_output_line(result, line, f"{path}:{lineno}")
    if not result.tokens:
        raise UserError(f"--outputs {path} is empty; pass the outputs.jsonl of a finished report")
    return result


def read_report_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        report = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{file}: not readable JSON ({e}); pass an intact report") from e
    if not isinstance(report, dict):
        raise UserError(f"{file}: not a report (a JSON {type(report).__name__}); pass an intact report")
    return report


def _read_output_line(result: ReportOutputs, line: str, where: str) -> None:
    try:
        row = json.loads(line)
        tokens = row.get("baseline_token_ids") or row.get("speculative_token_ids")
        if "id" not in row or not isinstance(tokens, list):
            raise ValueError("no id or token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise ValueError("a token id that is not a non-negative integer")
    except (ValueError, AttributeError) as e:
        raise UserError(f"{where}: not an outputs.jsonl line ({e}); pass a report's outputs.jsonl") from e
    pid = str(row["id"])
    result.tokens[pid] = tokens
    if isinstance(row.get("prompt_sha256"), str):
        result.digests[pid] = row["prompt_sha256"]


def parse_draft(arg: str) -> tuple[str, DrafterKind, str]:
    """NAME=DIR or NAME=FLAG:DIR -> (name, its drafter kind, directory)."""
    name, sep, path = arg.partition("=")
    kinds = replayed_kinds()
    prefix = next((p for p in kinds if p and path.startswith(p + ":")), "")
    path = path.removeprefix(prefix + ":") if prefix else path
    if not sep or not name or not path:
        raise UserError(f"--draft {arg!r}: write {replay_spellings()}")
    return name, kinds[prefix], path


def parse_drafts(specs: list[str]) -> list[tuple[str, DrafterKind, str]]:
    """Every --draft, names unique: results are printed by name, so two alike could not be told apart."""
    drafts = [parse_draft(d) for d in specs]
    names = [name for name, _, _ in drafts]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise UserError(f"--draft name {duplicate!r} is given twice; give each --draft its own NAME")
    return drafts


def replay_max_new_tokens(cfg: ReplayConfig, outputs: ReportOutputs) -> int:
    """The report's --max-new-tokens: it decides where the decoder's last steps draft fewer tokens,
    so a different one would replay steps the report never took."""
    reported = outputs.config.get("max_new_tokens")
    if cfg.max_new_tokens is not None and reported is not None and cfg.max_new_tokens != reported:
        raise UserError(f"--max-new-tokens {cfg.max_new_tokens} differs from the report's {reported} (its report.json "
                        "beside --outputs); leave --max-new-tokens out to use the report's")
    max_new = cfg.max_new_tokens or reported
    if not isinstance(max_new, int) or max_new < 1:
        raise UserError(f"the report's --max-new-tokens is unknown (no report.json beside {cfg.outputs}); pass "
                        "--max-new-tokens N as the report ran")
    longest = max(len(t) for t in outputs.tokens.values())
    if longest > max_new:
        raise UserError(f"{cfg.outputs} holds an output of {longest} tokens, more than --max-new-tokens {max_new}; "
                        "pass the report's --max-new-tokens")
    return max_new


def check_target(cfg: ReplayConfig, outputs: ReportOutputs) -> None:
    """The outputs must be this target's: another target's outputs replay to a meaningless tau
    (1.0 for a draft that is that target). Checked by the fingerprint the report records, else,
    for an older report, by its target path where that path exists here."""
    from .report import target_fingerprint

    recorded = outputs.report.get("inputs")
    recorded = recorded if isinstance(recorded, dict) else {}
    reported = recorded.get("target") or outputs.config.get("target")
    if not isinstance(reported, str) or not reported:
        return
    expected, local = recorded.get("target_fingerprint"), Path(cfg.target).is_dir()
    if expected is not None and local:
        same = target_fingerprint(cfg.target) == expected
        if not same and Path(reported).resolve() == Path(cfg.target).resolve():
            raise UserError(f"{cfg.outputs} was made with the target at {reported!r}, but the weights there changed "
                            "since: their fingerprint differs from the one its report.json recorded; pass the target "
                            "the report ran, or the outputs of a report on these weights")
    elif Path(reported).is_dir() and local:
        same = Path(reported).resolve() == Path(cfg.target).resolve()
    elif not local and not Path(reported).exists():  # two hub ids
        same = reported == cfg.target
    else:  # a local path the report named that does not exist here: nothing to compare
        same = True
    if not same:
        raise UserError(f"{cfg.outputs} was made with the target {reported!r} (its report.json), not --target "
                        f"{cfg.target!r}; pass the report's target, or the outputs of a report on this target")


def matched_prompts(cfg: ReplayConfig, outputs: ReportOutputs, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target output) per prompt of cfg.prompts that has an output. Every output must
    have its prompt, and where the report records each prompt's hash, the same prompt: other
    prompts under the same ids would replay to a wrong tau."""
    from .report import prompt_digest

    records = [r for r in read_prompts(cfg.prompts) if str(r.id) in outputs.tokens]
    if not records:
        raise UserError(f"no prompt of {', '.join(cfg.prompts)} has an output in {cfg.outputs}; pass the prompt "
                        "file the report ran")
    missing = sorted(set(outputs.tokens) - {str(r.id) for r in records})
    if missing:
        raise UserError(f"{cfg.outputs} holds outputs of prompts not in {', '.join(cfg.prompts)} (ids "
                        f"{', '.join(map(repr, missing[:3]))}{', ...' if len(missing) > 3 else ''}); pass the prompt "
                        "file(s) the report ran")
    prompts = []
    for r in records:
        ids = encode_prompt(r, tokenizer)
        expected = outputs.digests.get(str(r.id))
        if expected is not None and prompt_digest(ids) != expected:
            raise UserError(f"{r.source}: prompt {r.id!r} is not the prompt the report decoded under that id (it "
                            f"encodes differently); pass the prompt file the report ran")
        prompts.append((ids, outputs.tokens[str(r.id)]))
    return prompts


def require_known_tokens(outputs: ReportOutputs, model, what: str) -> None:
    """Every output token must index `model`'s embedding: one past it means outputs of another
    vocabulary (and would be an IndexError deep in the forward)."""
    rows = model.get_input_embeddings().num_embeddings
    bad = next(((pid, t) for pid, tokens in outputs.tokens.items() for t in tokens if t >= rows), None)
    if bad is not None:
        raise UserError(f"{outputs.path}: prompt {bad[0]!r}'s output holds token id {bad[1]}, outside the {what}'s "
                        f"vocabulary of {rows} tokens; pass outputs of a report on this target")


def load_replay_draft(name: str, kind: DrafterKind, path: str, target, tokenizer, dtype, device):
    """The drafter (`Drafter`) loaded by its kind, checked against the target: one error line naming it."""
    try:
        return kind.load(path, target, tokenizer, device, dtype)
    except UserError as e:
        raise UserError(f"--draft {name!r}: {e}") from e


def check_plot_path(cfg: ReplayConfig) -> None:
    """--plot is checked before any model loads: a run that cannot write its figure fails at once."""
    if cfg.plot is None:
        return
    plot = Path(cfg.plot)
    if plot.suffix.lower() != ".png":
        raise UserError(f"--plot {cfg.plot!r}: name a .png file")
    if not plot.parent.is_dir():
        raise UserError(f"--plot {cfg.plot!r}: its directory {str(plot.parent)!r} does not exist; create it first")
    if plot.exists() and not cfg.overwrite:
        raise UserError(f"--plot {cfg.plot!r} already exists; pass --overwrite to replace it, or choose a new file")


def window_series(outputs: ReportOutputs, results: list[ReplayResult]) -> dict[str, list[dict]]:
    """tau by window per line of the plot: the report's own drafter as its report recorded it (at its
    own K, decoded and not replayed), then every replayed draft."""
    series = {}
    recorded = outputs.report.get("by_window")
    if isinstance(recorded, list) and recorded:
        k = outputs.config.get("num_draft_tokens")
        series[f"{outputs.report.get('drafter', 'report')} (report, K={k})"] = recorded
    for r in results:
        series[f"{r.name} (replayed, K={r.num_draft_tokens})"] = r.by_window
    return series


def save_window_plot(cfg: ReplayConfig, outputs: ReportOutputs, results: list[ReplayResult]) -> None:
    """The figure written whole: drawn to a temporary file beside --plot, then moved over it."""
    from .report import save_figure, window_figure

    prompts = len(results[0].tokens) if results else 0
    fig = window_figure(window_series(outputs, results), f"tau by output window ({cfg.acceptance_window} tokens)",
                        f"greedy replay over {outputs.path}, {prompts} prompts, up to {results[0].max_new_tokens} "
                        "new tokens")
    plot = Path(cfg.plot)
    partial = plot.with_name(f".{plot.name}.partial.png")
    try:
        save_figure(fig, partial)
        partial.replace(plot)
    finally:
        partial.unlink(missing_ok=True)


def run_replay(cfg: ReplayConfig, progress: bool = True) -> list[ReplayResult]:
    from tqdm.auto import tqdm

    check_settings(cfg, flag_name)
    check_plot_path(cfg)
    drafts = parse_drafts(cfg.draft)
    outputs = read_outputs(cfg.outputs)
    max_new = replay_max_new_tokens(cfg, outputs)
    check_target(cfg, outputs)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    tokenizer = load_tokenizer(cfg.target, "target")
    prompts = matched_prompts(cfg, outputs, tokenizer)
    target = load_causal_lm(cfg.target, dtype, device, "target")  # every drafter is checked against it
    require_known_tokens(outputs, target, "target")
    results = []
    for name, kind, path in drafts:
        drafter = load_replay_draft(name, kind, path, target, tokenizer, dtype, device)
        if hasattr(drafter.model, "get_input_embeddings"):  # a draft LM embeds the outputs itself
            require_known_tokens(outputs, drafter.model, f"draft {name!r}")
        result, gens = ReplayResult(name, cfg.num_draft_tokens, max_new), []
        with tqdm(prompts, desc=name, unit="prompt", disable=not progress) as bar:
            for ids, out in bar:
                acc, prop = teacher_forced_steps(drafter, ids, out, num_draft_tokens=cfg.num_draft_tokens,
                                                 max_new_tokens=max_new, target=target)
                result.tokens.append(len(out))
                result.accepted.append(acc)
                result.proposed.append(prop)
                gens.append(Generation(tokens=out, accepted_lengths=acc, proposed_lengths=prop))
        result.by_window = acceptance_by_window(gens, cfg.acceptance_window, cfg.num_draft_tokens)
        results.append(result)
        del drafter
    if cfg.plot is not None:
        save_window_plot(cfg, outputs, results)
    return results


def format_results(results: list[ReplayResult]) -> list[str]:
    """Per draft: its tau and acceptance, tau per prompt, then one line per output window."""
    lines = []
    for r in results:
        lines.append(f"{r.name}: tau {r.tau:.3f}, acceptance {r.acceptance_rate:.3f} over {len(r.tokens)} prompts "
                     f"(K={r.num_draft_tokens}, max new tokens {r.max_new_tokens}); per prompt "
                     + " ".join(f"{t:.2f}" for t in r.per_prompt_tau))
        lines += [f"  output tokens {w['start']}-{w['end']}: tau {w['tau']:.3f}, acceptance {w['acceptance']:.3f} "
                  f"({w['prompts']} prompts, {w['steps']} steps)" for w in r.by_window]
    return lines
