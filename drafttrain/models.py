"""Loading target and draft models: device/dtype resolution and friendly errors for bad paths."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import torch

from .errors import UserError

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise UserError(f"unknown device {name!r}; use one of auto, cpu, cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {name!r} was asked for but CUDA is not available; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on CUDA and fp32 on CPU (CPU bf16 matmuls are slow and lossy)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # `name` or `org/name`


def check_model_path(path: str, what: str) -> None:
    """A path that looks local must exist; anything shaped like a hub id (`org/name`) is one."""
    looks_local = Path(path).exists() or path.startswith((".", "~", os.sep)) or not HUB_ID.fullmatch(path)
    if looks_local and not Path(path).is_dir():
        raise UserError(f"{what} {path!r} is not a directory; pass a model directory or a hub id")


def load_tokenizer(path: str, what: str = "model"):
    from transformers import AutoTokenizer

    check_model_path(path, what)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load the {what} tokenizer from {path!r} ({first_line(e)}); "
                        "pass a directory with tokenizer files") from e


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_model_files(path: str, what: str) -> None:
    """A local model directory needs config.json and a weights file: say which is missing."""
    root = Path(path)
    if not root.is_dir():
        return  # a hub id
    if not (root / "config.json").is_file():
        raise UserError(f"{what} {path!r} has no config.json; pass a model directory saved with save_pretrained")
    if not any((root / name).is_file() for name in WEIGHT_FILES):
        raise UserError(f"{what} {path!r} has no weights (model.safetensors); pass a complete model directory "
                        "or export the model again")


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device, what: str = "model"):
    """A causal LM in eval mode, or one `UserError` line for anything that stops it loading: a
    missing or damaged file, an unknown architecture, or weights that are not finite."""
    from transformers import AutoModelForCausalLM

    check_model_path(path, what)
    check_model_files(path, what)
    try:
        with quiet_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load the {what} from {path!r} ({first_line(e)}); "
                        "pass a directory with config.json and weights") from e
    except Exception as e:  # safetensors' SafetensorError (truncated, empty or garbled file) and the like
        raise UserError(f"cannot load the {what} from {path!r}: its weights file is damaged ({first_line(e)}); "
                        "export or download the model again") from e
    bad = next((name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if bad is not None:
        raise UserError(f"the {what} at {path!r} has non-finite weights (NaN or inf in {bad}); the file is damaged: "
                        "export or download the model again")
    return model.to(device).eval()


def is_sharded_module(model: torch.nn.Module) -> bool:
    """True when `model`'s weights are split across ranks (FSDP2 DTensors or ZeRO-3 partitions),
    so no rank may read them outside a forward (`training.frozen`)."""
    p = next(model.parameters(), None)
    return p is not None and (hasattr(p, "ds_id") or hasattr(p, "_local_tensor"))


@contextlib.contextmanager
def quiet_progress_bars():
    """No "Loading weights" bars on stderr: a failed command must print only its one `error:` line."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def context_length(model) -> int | None:
    cfg = model.config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
