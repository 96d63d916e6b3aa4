from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import pytest
import yaml

from drafttrain.config import (
    add_flags,
    check_settings,
    config_from_argv,
    config_to_dict,
    describe_config,
    dump_config_yaml,
    from_args,
    load_config,
    setting,
    undocumented_fields,
)
from drafttrain.errors import UserError


@dataclass
class Source:
    path: str = setting(doc="JSONL file to read.")
    weight: float = setting(1.0, "Sampling weight.")


@dataclass
class Optim:
    lr: float = setting(3e-4, "Peak learning rate.")
    betas: tuple[float, float] = setting((0.9, 0.95), "AdamW betas.")
    schedule: Literal["cosine", "linear", "constant"] = setting("cosine", "LR schedule.")


@dataclass
class Data:
    sources: list[Source] = setting([], doc="Training sources.")
    max_len: int = setting(512, "Tokens per sequence.")
    seed: Optional[int] = setting(None, "Shuffle seed; null = unshuffled.")


@dataclass
class Teacher:
    path: str = setting(doc="Teacher model directory.")
    temperature: float = setting(1.0, "Softmax temperature.")


@dataclass
class Recipe:
    run_name: str = setting("run", "Name of the run.")
    steps: int = setting(100, "Optimizer steps.")
    bf16: bool = setting(False, "Train in bfloat16.")
    tags: list[str] = setting(["a"], doc="Free-form tags.")
    out: Path = setting(Path("out"), "Output directory.")
    optim: Optim = setting(Optim(), doc="Optimizer settings.")
    data: Data = setting(Data(), doc="Data settings.")
    teacher: Optional[Teacher] = setting(None, "Optional teacher.")


@dataclass
class Sloppy:
    ok: int = setting(1, "Documented.")
    bad: int = 2
    inner: Source = dataclasses.field(default_factory=lambda: Source("x"))


def write(tmp_path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_yaml_and_overrides(tmp_path):
    cfg = load_config(Recipe, None, [])
    assert cfg == Recipe()
    path = write(tmp_path, """
steps: 7
optim:
  lr: 1e-3          # YAML 1.1 reads this as a string; a float field must still accept it
  schedule: linear
data:
  sources:
    - {path: a.jsonl}
    - {path: b.jsonl, weight: 2}
""")
    cfg = load_config(Recipe, path, ["optim.lr=2e-5", "data.seed=3", "bf16=true", "run_name=2024",
                                     "teacher.path=/t", "tags=[x, y]"])
    assert cfg.steps == 7 and cfg.bf16 is True and cfg.run_name == "2024"
    assert cfg.optim == Optim(lr=2e-5, schedule="linear") and isinstance(cfg.optim.lr, float)
    assert cfg.data.sources == [Source("a.jsonl"), Source("b.jsonl", 2.0)]
    assert isinstance(cfg.data.sources[1].weight, float)
    assert cfg.data.seed == 3 and cfg.tags == ["x", "y"] and cfg.teacher == Teacher("/t")
    assert cfg.out == Path("out") and cfg.optim.betas == (0.9, 0.95)
    # overrides replace whole lists and can null an Optional
    cfg = load_config(Recipe, path, ["data.sources=[{path: c}]", "data.seed=null", "optim.betas=[0.8, 0.9]"])
    assert cfg.data.sources == [Source("c")] and cfg.data.seed is None and cfg.optim.betas == (0.8, 0.9)


def test_mutable_defaults_are_not_shared():
    a, b = Recipe(), Recipe()
    a.tags.append("z")
    a.optim.lr = 1.0
    assert b.tags == ["a"] and b.optim.lr == 3e-4


@pytest.mark.parametrize("override, words", [
    (["optim.lrr=1"], ["'optim.lrr'", "'optim.lr'"]),
    (["lr=1"], ["'lr'", "'optim.lr'"]),
    (["data.sources=[{path: a, wieght: 2}]"], ["'data.sources[0].wieght'", "'data.sources[0].weight'"]),
    (["optim.lr=fast"], ["'optim.lr'", "float", "'fast'"]),
    (["steps=1.5"], ["'steps'", "int", "1.5"]),
    (["bf16=3"], ["'bf16'", "bool", "3"]),
    (["optim.schedule=step"], ["'optim.schedule'", "'cosine'", "'step'"]),
    (["optim.betas=[1]"], ["'optim.betas'", "2 items"]),
    (["tags=x"], ["'tags'", "list[str]"]),
    (["teacher.temperature=2"], ["'teacher.path'", "required"]),
    (["steps"], ["'steps'", "key=value"]),
    (["optim=3"], ["'optim'", "section"]),
    (["steps.x=1"], ["'steps'", "expects int", "{'x': 1}"]),
])
def test_override_errors_name_the_key(override, words):
    with pytest.raises(UserError) as e:
        load_config(Recipe, None, override)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_yaml_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(Recipe, tmp_path / "missing.yaml", [])
    with pytest.raises(UserError, match=r"unknown config key 'data.max_lenn'; did you mean 'data.max_len'"):
        load_config(Recipe, write(tmp_path, "data:\n  max_lenn: 3\n"), [])
    with pytest.raises(UserError, match="mapping"):
        load_config(Recipe, write(tmp_path, "- 1\n- 2\n"), [])
    with pytest.raises(UserError, match=r"'steps' is a value, not a section"):
        load_config(Recipe, write(tmp_path, "steps: 3\n"), ["steps.x=1"])
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(Recipe, write(tmp_path, "a: [1,\n"), [])
    with pytest.raises(UserError, match=r"'run_name' expects str; got 5"):
        load_config(Recipe, write(tmp_path, "run_name: 5\n"), [])  # only command-line text is coerced
    assert load_config(Recipe, write(tmp_path, ""), []) == Recipe()


def test_dump_round_trips(tmp_path):
    cfg = load_config(Recipe, None, ["data.sources=[{path: a}, {path: b, weight: 0.5}]", "teacher.path=t",
                                      "optim.schedule=constant", "out=/x/y"])
    text = dump_config_yaml(cfg)
    plain = yaml.safe_load(text)
    assert plain == config_to_dict(cfg)
    assert plain["optim"]["betas"] == [0.9, 0.95] and plain["out"] == "/x/y"
    assert plain["data"]["sources"][1] == {"path": "b", "weight": 0.5}
    assert load_config(Recipe, write(tmp_path, text), []) == cfg


def test_every_field_is_documented_and_described():
    assert undocumented_fields(Recipe) == []
    assert undocumented_fields(Sloppy) == ["bad", "inner"]
    text = describe_config(Recipe)
    expected = {"run_name", "steps", "bf16", "tags", "out", "optim", "optim.lr", "optim.betas",
                "optim.schedule", "data", "data.sources", "data.sources[].path", "data.sources[].weight",
                "data.max_len", "data.seed", "teacher", "teacher.path", "teacher.temperature"}
    listed = {line.split(":")[0] for line in text.splitlines()[2:] if line and not line.startswith(" ")}
    assert listed == expected
    assert "optim.lr: float = 0.0003\n    Peak learning rate." in text
    assert "optim.schedule: 'cosine' | 'linear' | 'constant' = \"cosine\"" in text
    assert "teacher.path: str = (required)" in text
    assert "data.seed: int | null = null" in text


def test_documented_requires_doc():
    with pytest.raises(ValueError):
        setting(1, doc="  ")


def test_config_from_argv(tmp_path, capsys):
    path = write(tmp_path, "steps: 9\n")
    cfg = config_from_argv(Recipe, ["--config", path, "optim.lr=0.1"])
    assert cfg.steps == 9 and cfg.optim.lr == 0.1
    assert config_from_argv(Recipe, [f"--config={path}"]).steps == 9
    with pytest.raises(UserError, match="unknown option '--lr'"):
        config_from_argv(Recipe, ["--lr", "1"])
    with pytest.raises(SystemExit):
        config_from_argv(Recipe, ["--help"])
    assert "optim.lr" in capsys.readouterr().out


def test_parse_argv_takes_the_flags_it_is_given(tmp_path, capsys):
    from drafttrain.config import parse_argv

    flags = {"--overwrite": "Start over."}
    cfg, given = parse_argv(Recipe, ["steps=3", "--overwrite"], flags=flags)
    assert cfg.steps == 3 and given == {"--overwrite"}
    assert parse_argv(Recipe, ["steps=3"], flags=flags)[1] == set()
    with pytest.raises(UserError, match="unknown option '--overwrite'; recipes take --config FILE and"):
        parse_argv(Recipe, ["--overwrite"])
    with pytest.raises(SystemExit):
        parse_argv(Recipe, ["--help"], prog="r.py", flags=flags)
    out = capsys.readouterr().out
    assert out.startswith("usage: r.py --config FILE.yaml [--overwrite] [key=value ...]") and "Start over." in out


# ----------------------------------------------------------------------------- declared constraints


@dataclass
class Bounded:
    steps: int = setting(1, "Steps.", at_least=1)
    rate: float = setting(0.5, "A fraction.", above=0, at_most=1)
    drop: float = setting(0.0, "Dropout.", at_least=0, below=1)
    alphas: list[float] = setting([0.5], "Rates.", at_least=0, at_most=1)
    mode: str = setting("a", "Mode.", choices=("a", "b"))
    limit: Optional[int] = setting(None, "Unset: all.", at_least=1)


@dataclass
class Outer:
    inner: Bounded = setting(Bounded(), doc="Nested settings.")


@pytest.mark.parametrize("override, message", [
    ({"steps": 0}, "inner.steps must be at least 1, got 0"),
    ({"rate": 0.0}, "inner.rate must be in (0, 1], got 0.0"),
    ({"rate": 1.5}, "inner.rate must be in (0, 1], got 1.5"),
    ({"rate": float("nan")}, "inner.rate must be in (0, 1], got nan"),
    ({"drop": 1.0}, "inner.drop must be in [0, 1), got 1.0"),
    ({"alphas": [0.5, 1.2]}, "inner.alphas must be in [0, 1], got [0.5, 1.2]"),
    ({"mode": "c"}, "unknown inner.mode 'c'; use one of a, b"),
    ({"limit": 0}, "inner.limit must be at least 1, got 0"),
])
def test_check_settings_enforces_what_the_field_declares(override, message):
    with pytest.raises(UserError) as e:
        check_settings(Outer(inner=Bounded(**override)))
    assert str(e.value) == message


def test_check_settings_accepts_the_edges_and_labels_flags():
    check_settings(Outer(inner=Bounded(steps=1, rate=1.0, drop=0.0, alphas=[0.0, 1.0], limit=None)))
    with pytest.raises(UserError, match=r"^--steps must be at least 1, got -3$"):
        check_settings(Bounded(steps=-3), label=lambda key: "--" + key.replace("_", "-"))


def test_flags_come_from_the_same_fields(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser, Bounded)
    args = parser.parse_args(["--steps", "3", "--alphas", "0.1", "--alphas", "0.2", "--mode", "b"])
    cfg = from_args(Bounded, args)
    assert (cfg.steps, cfg.alphas, cfg.mode, cfg.rate, cfg.limit) == (3, [0.1, 0.2], "b", 0.5, None)
    assert from_args(Bounded, parser.parse_args([])).alphas == [0.5]  # the default, not a shared list
    with pytest.raises(UserError, match="unknown --mode 'c'"):  # a flag's choices: the config's own check
        check_settings(from_args(Bounded, parser.parse_args(["--mode", "c"])), label=lambda k: "--" + k)


def test_a_config_that_is_not_utf8_is_one_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run_name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"is not UTF-8 text \(byte 13: invalid continuation byte\); save it as UTF-8"):
        load_config(Recipe, path)
