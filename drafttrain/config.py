"""Recipe configs: YAML files + dotted `key=value` overrides, checked against documented dataclasses.

A recipe declares its config as nested dataclasses whose fields carry a doc string
(`setting(...)`). `load_config` reads the YAML, applies overrides such as `optim.lr=1e-4`,
and builds the dataclasses, so a typo or a wrong type fails at start-up with a one-line
`UserError` instead of hours into a run. `describe_config` turns the same dataclasses into the
reference of every key, so the docs cannot drift from the code.

    @dataclass
    class OptimConfig:
        lr: float = setting(3e-4, doc="Peak learning rate.")

    @dataclass
    class Config:
        optim: OptimConfig = setting(OptimConfig(), doc="Optimizer settings.")

    cfg = load_config(Config, "recipes/configs/x.yaml", ["optim.lr=1e-4"])
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from .errors import UserError

T = TypeVar("T")

_MUTABLE = (list, dict, set)


# ----------------------------------------------------------------------------- declaring fields


def setting(default: Any = dataclasses.MISSING, doc: str = "", *, default_factory: Any = dataclasses.MISSING,
            choices: tuple | None = None, at_least: float | None = None, above: float | None = None,
            at_most: float | None = None, below: float | None = None, metavar: str | None = None,
            **metadata: Any) -> Any:
    """A settings field: the one way every setting of drafttrain is declared, for recipe configs
    (YAML keys), for `eval`/`compare`/`replay` and for `bench` (flags, `add_flags`).

    `doc` becomes the --help text and the config reference. The constraints (`choices`; the
    bounds `at_least`, `above`, `at_most`, `below`, checked on numbers and on each element of a
    list) are declared here, on the field, and enforced by `check_settings`, so a command checks
    ranges without code of its own. Mutable defaults (lists, dicts, dataclass instances) are
    copied per instance, so `setting([], doc=...)` is safe. `metadata` carries anything else a
    command reads off the field (e.g. eval's `drafter`)."""
    if not doc or not doc.strip():
        raise ValueError("setting() needs a non-empty doc")
    if default is not dataclasses.MISSING and default_factory is not dataclasses.MISSING:
        raise ValueError("pass either default or default_factory, not both")
    if isinstance(default, _MUTABLE) or (dataclasses.is_dataclass(default) and not isinstance(default, type)):
        value = default
        default, default_factory = dataclasses.MISSING, (lambda: copy.deepcopy(value))
    bounds = {k: v for k, v in (("at_least", at_least), ("above", above), ("at_most", at_most), ("below", below))
              if v is not None}
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"doc": doc.strip(), "choices": choices, "metavar": metavar, "bounds": bounds,
                                       **metadata})


def bound_text(bounds: dict, integer: bool) -> str:
    """'at least 1', '>= 0', '> 0', 'in (0, 1]', ... for an error message."""
    lo = ("[", bounds["at_least"]) if "at_least" in bounds else ("(", bounds["above"]) if "above" in bounds else None
    hi = ("]", bounds["at_most"]) if "at_most" in bounds else (")", bounds["below"]) if "below" in bounds else None
    if lo and hi:
        return f"in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo:
        if integer and lo[0] == "[":
            return f"at least {lo[1]}"
        return f"{'>=' if lo[0] == '[' else '>'} {lo[1]}"
    return f"{'<=' if hi[0] == ']' else '<'} {hi[1]}"


def _within(value, bounds: dict) -> bool:
    """Whether a number lies within the bounds (NaN never does)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return False
    return (value >= bounds.get("at_least", value) and value > bounds.get("above", value - 1)
            and value <= bounds.get("at_most", value) and value < bounds.get("below", value + 1))


def check_settings(obj, label=lambda key: key, prefix: str = "") -> None:
    """Enforce every field's declared `choices` and bounds (nested settings too): one UserError
    naming the setting as `label(dotted key)` shows it (a YAML key, or a flag) and the allowed range."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_settings(value, label, key + ".")
            continue
        if value is None:
            continue
        choices, bounds = f.metadata.get("choices"), f.metadata.get("bounds")
        if choices and value not in choices:
            raise UserError(f"unknown {label(key)} {value!r}; use one of {', '.join(map(str, choices))}")
        if bounds and not (value == "auto" and f.metadata.get("auto")):
            values = value if isinstance(value, (list, tuple)) else [value]
            bad = next((v for v in values if not _within(v, bounds)), None)
            if bad is not None or (isinstance(value, float) and value != value):
                integer = all(isinstance(b, int) for b in bounds.values()) and isinstance(bad, int)
                raise UserError(f"{label(key)} must be {bound_text(bounds, integer)}, got {value}")


def field_doc(f: dataclasses.Field) -> str:
    return str(f.metadata.get("doc", "")).strip()


# ----------------------------------------------------------------------------- loading


def load_config(cls: type[T], yaml_path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Build `cls` from an optional YAML file plus dotted `key=value` overrides (later wins)."""
    data: dict = {}
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise UserError(f"config file {str(path)!r} does not exist; pass an existing YAML file to --config")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise UserError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}); save it as "
                            "UTF-8") from e
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" line {where.line + 1}" if where is not None else ""
            raise UserError(f"config file {str(path)!r}{line} is not valid YAML "
                            f"({getattr(e, 'problem', None) or type(e).__name__}); fix its syntax") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise UserError(f"config file {str(path)!r} must hold a mapping of keys to values, "
                            f"not a {type(loaded).__name__}")
        data = loaded or {}
    for item in overrides:
        apply_override(data, item)
    return from_dict(cls, data)


def config_from_argv(cls: type[T], argv: list[str] | None = None, prog: str = "recipe") -> T:
    """Parse a recipe's command line, `--config FILE [key=value ...]`; `--help` lists every key."""
    return parse_argv(cls, argv, prog)[0]


def parse_argv(cls: type[T], argv: list[str] | None = None, prog: str = "recipe",
               flags: dict[str, str] | None = None) -> tuple[T, set[str]]:
    """(config, the `flags` given): `--config FILE [--FLAG ...] [key=value ...]`, where `flags` maps
    each allowed on/off flag (e.g. "--overwrite") to its help text; `--help` lists flags and keys."""
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = flags or {}
    yaml_path, overrides, given = None, [], set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            usage = f"usage: {prog} --config FILE.yaml {''.join(f'[{f}] ' for f in flags)}[key=value ...]"
            options = "".join(f"{f}\n    {text}\n" for f, text in flags.items())
            print(f"{usage}\n\n{options + chr(10) if options else ''}{describe_config(cls)}")
            raise SystemExit(0)
        if arg == "--config":
            if i + 1 >= len(argv):
                raise UserError("--config needs a value; write --config recipes/configs/NAME.yaml")
            yaml_path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            yaml_path = arg.split("=", 1)[1]
        elif arg in flags:
            given.add(arg)
        elif arg.startswith("-"):
            known = ", ".join(["--config FILE", *flags])
            raise UserError(f"unknown option {arg!r}; recipes take {known} and key=value overrides (see --help)")
        else:
            overrides.append(arg)
        i += 1
    return load_config(cls, yaml_path, overrides), given


def apply_override(data: dict, item: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (ints, floats, lists, null)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"override {item!r} is not of the form key=value; write e.g. optim.lr=1e-4")
    parts = key.split(".")
    if any(not p for p in parts):
        raise UserError(f"override key {key!r} has an empty part; write dotted keys like optim.lr")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text  # e.g. `prompt=a: b` - keep the text as it is
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if isinstance(child, _Override) and isinstance(child.value, dict):
            child = node[part] = child.value  # `optim={lr: 1}` then `optim.wd=0`
        if isinstance(child, _Override) and child.value is None:
            child = None
        if not isinstance(child, dict):
            if child is not None:
                raise UserError(f"override {item!r}: {'.'.join(parts[:i + 1])!r} is a value, not a section; "
                                f"set it directly with {'.'.join(parts[:i + 1])}=...")
            child = node[part] = {}
        node = child
    node[parts[-1]] = _Override(text.strip(), value)


@dataclasses.dataclass(frozen=True)
class _Override:
    """An override's raw text next to its YAML reading, so `name=2024` can still be a str."""

    text: str
    value: Any


def from_dict(cls: type[T], data: Any, prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping, checking every key and value."""
    if isinstance(data, _Override):
        data = data.value
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise UserError(f"config key {prefix[:-1] or '<root>'!r} is a section ({cls.__name__}); "
                        f"give it a mapping of keys, not {_show(data)}")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise UserError(_unknown_key_message(cls, prefix, str(key)))
    kwargs = {}
    for name, f in fields.items():
        dotted = f"{prefix}{name}"
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], dotted)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise UserError(f"config key {dotted!r} is required; set it in the YAML file or pass {dotted}=...")
    try:
        return cls(**kwargs)
    except ValueError as e:  # a __post_init__ check of the recipe
        raise UserError(f"invalid config{' section ' + repr(prefix[:-1]) if prefix else ''}: {e}") from e


def _convert(value: Any, tp: Any, key: str) -> Any:
    raw = value.text if isinstance(value, _Override) else None
    if isinstance(value, _Override):
        value = value.value
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    if tp is Any:
        return value
    if _is_union(tp):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _convert(_Override(raw, value) if raw is not None else value, option, key)
            except UserError as e:
                errors.append(e)
        if len(options) == 1:
            raise errors[0]
        raise _type_error(key, tp, value)
    if origin is Literal:
        if any(a == value and type(a) is type(value) for a in args):
            return value
        if raw is not None and raw in args:  # `mode=1` where the choices are strings
            return raw
        choices = ", ".join(repr(a) for a in args)
        raise UserError(f"config key {key!r} must be one of {choices}; got {value!r}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")
    if origin in (list, tuple, set, frozenset) or tp in (list, tuple):
        if isinstance(value, (tuple, set)):
            value = list(value)
        if not isinstance(value, list):
            raise _type_error(key, tp, value)
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise UserError(f"config key {key!r} expects {len(args)} items ({_type_name(tp)}); got {value!r}")
            return tuple(_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return (origin or tp)(items) if (origin or tp) is not list else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _type_error(key, tp, value)
        key_tp, val_tp = args if args else (Any, Any)
        return {_convert(k, key_tp, key): _convert(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(key, tp, value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():  # `steps=1e4`
            return int(value)
        raise _type_error(key, tp, value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise _type_error(key, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        if raw is not None and isinstance(value, (int, float)):  # `run_name=2024` on the command line
            return raw
        raise _type_error(key, tp, value)
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise _type_error(key, tp, value)
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _type_error(key, tp, value)
    raise TypeError(f"config key {key!r}: unsupported field type {tp!r}")


def _type_error(key: str, tp: Any, value: Any) -> UserError:
    return UserError(f"config key {key!r} expects {_type_name(tp)}; got {_show(value)}")


def _show(value: Any) -> str:
    value = _plain(value)
    return f"{value!r} ({type(value).__name__})"


def _plain(value: Any) -> Any:
    if isinstance(value, _Override):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _unknown_key_message(cls: type, prefix: str, key: str) -> str:
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    close = [prefix + n for n in difflib.get_close_matches(key, names, n=3, cutoff=0.6)]
    if not close:  # `lr=...` given at the top level: point at `optim.lr`
        close = [p for p in _dotted_names(cls, prefix) if p.rsplit(".", 1)[-1] == key][:3]
    if not close:
        close = difflib.get_close_matches(prefix + key, _dotted_names(cls, prefix), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else \
        f"valid keys here: {', '.join(names)}"
    return f"unknown config key {prefix + key!r}; {hint}"


def _dotted_names(cls: type, prefix: str = "") -> list[str]:
    return [name for name, _, _ in _walk(cls, prefix)]


# ----------------------------------------------------------------------------- dumping and docs


def config_to_dict(obj: Any) -> Any:
    """Plain YAML/JSON-safe data: dataclasses become dicts, tuples lists, paths strings."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: config_to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): config_to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [config_to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def dump_config_yaml(obj: Any) -> str:
    """The resolved config as YAML; loading it back with `load_config` gives an equal object."""
    return yaml.safe_dump(config_to_dict(obj), sort_keys=False, default_flow_style=False, allow_unicode=True)


def describe_config(cls: type) -> str:
    """Every key of the config tree: dotted name, type, default and doc, one entry per key."""
    lines = [f"{cls.__name__} keys (override any with key=value, e.g. on the command line):", ""]
    for name, f, tp in _walk(cls):
        lines.append(f"{name}: {_type_name(tp)} = {_default_text(f)}")
        lines.append(f"    {field_doc(f) or '(undocumented)'}")
    return "\n".join(lines) + "\n"


def undocumented_fields(cls: type) -> list[str]:
    """Dotted names of fields (at any depth) without a doc; a recipe's test asserts this is empty."""
    return [name for name, f, _ in _walk(cls) if not field_doc(f)]


def _walk(cls: type, prefix: str = "", seen: tuple = ()) -> typing.Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted name, field, type) for every field, depth first; items of `list[Section]` as `name[]`."""
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        name, tp = prefix + f.name, hints[f.name]
        yield name, f, tp
        for sub, suffix in _nested_dataclasses(tp):
            if sub not in seen:  # guard against self-referencing configs
                yield from _walk(sub, f"{name}{suffix}.", seen + (cls,))


def _nested_dataclasses(tp: Any) -> list[tuple[type, str]]:
    if dataclasses.is_dataclass(tp):
        return [(tp, "")]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(tp):
        return [x for a in args for x in _nested_dataclasses(a)]
    if origin in (list, tuple, set, frozenset) and args:
        return [(sub, "[]") for a in args if a is not Ellipsis for sub, _ in _nested_dataclasses(a)]
    if origin is dict and len(args) == 2:
        return [(sub, ".<key>") for sub, _ in _nested_dataclasses(args[1])]
    return []


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return "(required)"
    return json.dumps(config_to_dict(value))


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if args else origin.__name__
    return getattr(tp, "__name__", str(tp))


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) is Union or isinstance(tp, getattr(types, "UnionType", ()))


def _type_hints(cls: type) -> dict[str, Any]:
    """Resolve string annotations (`from __future__ import annotations`) of a config dataclass."""
    try:  # each class's own module resolves its annotations, so a recipe's config can extend a library one
        return typing.get_type_hints(cls)
    except NameError as e:
        raise TypeError(f"cannot resolve the field types of {cls.__name__} ({e}); define config "
                        "dataclasses at module level") from e


# ----------------------------------------------------------------------------- command-line flags from fields


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_flags(parser, cls, *, drafter: bool = True, docs: dict[str, str] | None = None) -> None:
    """One flag per field of `cls`: `--field-name`, typed by the annotation, its doc and default as
    help. `drafter=False` leaves out the fields marked `drafter`; `docs` replaces a field's help for
    this command. Field metadata: `choices`, `metavar`; `group` (fields sharing one are mutually
    exclusive flags); `negated` (a bool that defaults on: its flag is `--no-field-name`); `parse`
    (the flag's text -> the value, e.g. a comma-separated list)."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if meta.get("drafter") and not drafter:
            continue
        where = parser
        if meta.get("group"):
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_mutually_exclusive_group()
            where = groups[meta["group"]]
        doc = (docs or {}).get(f.name, meta["doc"]).replace("%", "%%")
        kind, repeated = _scalar_type(hints[f.name])
        if kind is bool:
            if meta.get("negated"):
                where.add_argument("--no-" + f.name.replace("_", "-"), action="store_false", dest=f.name,
                                   help=f"Do not: {doc[0].lower()}{doc[1:]}")
            else:
                where.add_argument(flag_name(f.name), action="store_true", help=f"{doc} (default: off)", dest=f.name)
            continue
        kwargs: dict = {"dest": f.name, "type": meta.get("parse") or kind}
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if meta.get("choices"):  # checked by check_settings, with the same message as in a config
            kwargs.setdefault("metavar", "{" + ",".join(map(str, meta["choices"])) + "}")
        default = _default(f)
        if default is dataclasses.MISSING:
            kwargs["required"] = True
            help_text = f"{doc} (required)"
        else:
            shown = ",".join(map(str, default)) if meta.get("parse") and isinstance(default, list) else default
            help_text = doc if default in (None, []) else f"{doc} (default: {shown})"
            if not repeated or meta.get("parse"):
                kwargs["default"] = default  # args read as they are parsed hold the field's default
        if repeated and not meta.get("parse"):
            kwargs["action"] = "append"  # argparse appends to a default list: start from none
        where.add_argument(flag_name(f.name), help=help_text, **kwargs)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def from_args(cls, args, **overrides):
    """The dataclass back from parsed flags (a flag not given takes its field's default);
    `overrides` set the fields the command fixes itself."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if getattr(args, f.name, None) is not None}
    values.update(overrides)
    return cls(**values)


def add_command(sub, name: str, cls, run, *, help: str):
    """A subcommand whose flags are the settings of `cls` (`add_flags`): `run(cfg)` gets the
    dataclass built from them and returns the exit code. Returns the subparser."""
    p = sub.add_parser(name, help=help)
    add_flags(p, cls)
    p.set_defaults(func=lambda args: run(from_args(cls, args)))
    return p


def _scalar_type(hint) -> tuple[type, bool]:
    """(argparse type, repeated flag) of an annotation: int, float, str, bool, X | None, list[X]."""
    origin = typing.get_origin(hint)
    if origin is list:
        return typing.get_args(hint)[0], True
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:  # X | None
        return _scalar_type(args[0])
    return hint, False
