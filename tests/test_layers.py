"""The package's layers (README, Layout): a module imports only from its own layer or lower ones,
as LAYERS lists them from the bottom: basics -> models and exports -> decoding -> drafter kinds ->
evaluation and bench -> data and losses -> training -> the command line. A kind's folder
(`kinds/<name>/`) spans layers by what each file is: its model, vocabulary, calibration and export sit
with the models, its run time and declaration (`kind.py`) in the kinds' layer, its loss with the losses. So the recipes' data and training sit
on top of evaluation (a recipe evaluates its drafter), and lower layers stay usable without the
higher ones. Read from the source with `ast`, imports inside functions
included; imports under `if TYPE_CHECKING:` are annotations' only (a drafter kind's methods name the
factory's `DecodeSettings`) and never run, so they are not counted."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "drafttrain"

LAYERS = [
    {"__init__", "errors", "fileio", "config", "home", "tokens", "trees", "planning"},  # basics
    {"models", "prompts", "export", "features", "corpus", "preflight", "assets", "kinds.model"},  # models, exports
    {"decoding"},                                                                       # decoders
    {"kinds"},                                                                          # drafter kinds, the factory
    {"evaluation", "bench"},                                                            # eval, compare, bench
    {"data", "losses", "kinds.loss"},                                                   # answers, losses
    {"training", "parity"},                                                             # the loop, recipes; the side-by-side
    {"cli"},                                                                            # the command line
]
KIND_MODELS = {"model", "export", "vocab", "calibrate", "layers"}  # a kind's files that sit with the models
# (and kinds/vocab.py, kinds/layers.py: the draft vocabulary and the layers the kinds' models share)


def unit(dotted: str) -> str:
    """'drafttrain.kinds.medusa.loss' -> 'kinds.loss', '...kinds.medusa.model' -> 'kinds.model' (a kind's
    files by what they are), else the first component below the package ('kinds' for a kind's run time)."""
    parts = dotted.split(".")[1:] or ["__init__"]
    if parts[0] == "kinds" and len(parts) in (2, 3) and parts[-1] == "loss":
        return "kinds.loss"
    if parts[0] == "kinds" and len(parts) in (2, 3) and parts[-1] in KIND_MODELS:
        return "kinds.model"
    return parts[0]


# A kind's folder imports no other kind's: what two kinds share lives in kinds/ (base, features, layers,
# vocab) or lower. The one family: a draft LM loads as a parallel draft when its config says so.
KIN = {("draft_lm", "parallel_lm"), ("parallel_lm", "draft_lm")}


def kind_folder(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "kinds" else None


def kind_crossings(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "kinds").glob("*/*.py")):
        me = path.parent.name
        for target in imports(path, root):
            other = kind_folder(target)
            if other not in (None, me) and (me, other) not in KIN:
                found.append(f"{path.relative_to(root.parent)} imports {target}")
    return found


def test_no_kind_imports_another_kind():
    assert not kind_crossings(PACKAGE), "\n".join(kind_crossings(PACKAGE))


def layer(name: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if name in names)


def imports(path: Path, root: Path) -> list[str]:
    """The drafttrain modules `path` (a file under the package directory `root`) imports."""
    module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if is_type_checking(block) for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name == "drafttrain":
                found += [f"drafttrain.{a.name}" for a in node.names]
            elif name.startswith("drafttrain."):
                found += [name] if node.module else [f"{name}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("drafttrain.")]
    return found


def is_type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) without an else: imports for annotations only."""
    test = getattr(node, "test", None)
    name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
    return isinstance(node, ast.If) and name == "TYPE_CHECKING" and not node.orelse


def module_unit(path: Path, root: Path) -> str:
    return unit(".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"))


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        me = module_unit(path, root)
        for target in imports(path, root):
            other = unit(target)
            if other != "__version__" and layer(other) > layer(me):
                found.append(f"{path.relative_to(root.parent)} imports {target}")
    return found


def test_no_module_imports_from_a_higher_layer():
    assert not violations(PACKAGE), "\n".join(violations(PACKAGE))


def test_every_module_has_a_layer():
    names = {module_unit(p, PACKAGE) for p in PACKAGE.rglob("*.py")}
    assert all(any(n in layer_names for layer_names in LAYERS) for n in names), names


def test_the_check_finds_imports_from_higher_layers(tmp_path):
    root = tmp_path / "drafttrain"
    (root / "decoding").mkdir(parents=True)
    (root / "kinds" / "medusa").mkdir(parents=True)
    (root / "decoding" / "ok.py").write_text("from ..trees import Path\nfrom . import lm\nimport drafttrain.errors\n")
    (root / "decoding" / "bad.py").write_text("def f():\n    from ..training.trainer import train\n")
    (root / "decoding" / "up.py").write_text("from ..kinds.registry import REGISTRY\n")
    (root / "kinds" / "medusa" / "model.py").write_text("from drafttrain.kinds.medusa.loss import x\n")
    (root / "kinds" / "medusa" / "export.py").write_text("from .kind import KIND\n")
    (root / "kinds" / "medusa" / "kind.py").write_text("from .model import MedusaHeads\nfrom ...decoding import chain\n")
    (root / "kinds" / "medusa" / "loss.py").write_text("from ...losses import distill_loss\nfrom .model import x\n")
    assert violations(root) == ["drafttrain/decoding/bad.py imports drafttrain.training.trainer",
                                "drafttrain/decoding/up.py imports drafttrain.kinds.registry",
                                "drafttrain/kinds/medusa/export.py imports drafttrain.kinds.medusa.kind",
                                "drafttrain/kinds/medusa/model.py imports drafttrain.kinds.medusa.loss"]


# Inside decoding/: how a model runs, then the loop and the acceptance rules, then the two
# decoders and the trees drafts grow, then what joins two drafters and what every decoder shares.
DECODING_LAYERS = [
    {"engines", "timing", "dynamic_tree"},
    {"verify", "loop", "batch"},
    {"chain", "tree"},
    {"hybrid", "settings", "__init__"},
]


def decoding_unit(dotted: str) -> str | None:
    """'drafttrain.decoding.engines.static' -> 'engines'; None outside decoding/."""
    parts = dotted.split(".")
    if parts[:2] != ["drafttrain", "decoding"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def decoding_violations(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "decoding").rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        me = decoding_unit(module)
        for target in imports(path, root):
            other = decoding_unit(target)
            if other is not None and layer_of(other) > layer_of(me):
                found.append(f"{path.relative_to(root.parent)} imports {target}")
    return found


def layer_of(name: str) -> int:
    return next(i for i, names in enumerate(DECODING_LAYERS) if name in names)


def test_decoding_modules_import_only_lower_concerns():
    assert not decoding_violations(PACKAGE), "\n".join(decoding_violations(PACKAGE))
    names = {decoding_unit(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"))
             for p in (PACKAGE / "decoding").rglob("*.py")}
    assert all(any(n in layer for layer in DECODING_LAYERS) for n in names), names


def test_imports_for_annotations_only_are_not_counted(tmp_path):
    root = tmp_path / "drafttrain"
    (root / "decoding" / "engines").mkdir(parents=True)
    (root / "decoding" / "engines" / "base.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..settings import DecodeSettings\n"
        "else:\n    from ..settings import NUM_DRAFT_TOKENS\n")
    (root / "decoding" / "engines" / "static.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..settings import DecodeSettings\n")
    found = decoding_violations(root)  # the else branch runs: both of base.py's imports count, none of static's
    assert found == ["drafttrain/decoding/engines/base.py imports drafttrain.decoding.settings"] * 2


def test_the_decoding_check_finds_an_engine_that_imports_a_higher_concern(tmp_path):
    root = tmp_path / "drafttrain"
    (root / "decoding" / "engines").mkdir(parents=True)
    (root / "decoding" / "engines" / "bad.py").write_text("from ..hybrid import hybrid_decoder\n")
    (root / "decoding" / "chain.py").write_text("from .engines import CachedLM\nfrom .verify import sample\n")
    assert decoding_violations(root) == ["drafttrain/decoding/engines/bad.py imports drafttrain.decoding.hybrid"]


def test_the_kind_check_finds_a_kind_importing_another(tmp_path):
    root = tmp_path / "drafttrain"
    for kind in ("dflash", "eagle3", "draft_lm", "parallel_lm"):
        (root / "kinds" / kind).mkdir(parents=True)
    (root / "kinds" / "dflash" / "model.py").write_text("from ..eagle3.model import RMSNorm\nfrom ..layers import x\n")
    (root / "kinds" / "draft_lm" / "kind.py").write_text("from ..parallel_lm.model import parallel_info\n")
    assert kind_crossings(root) == ["drafttrain/kinds/dflash/model.py imports drafttrain.kinds.eagle3.model"]
