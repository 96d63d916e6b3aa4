"""Loading models: every damaged or missing file is one UserError line, never a traceback."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import save_pair, tiny_lm, tiny_tokenizer

from drafttrain.errors import UserError
from drafttrain.models import load_causal_lm

CPU = torch.device("cpu")


@pytest.fixture()
def model_dir(tmp_path):
    return save_pair(tmp_path / "m", tiny_lm(0, dtype=torch.float32), tiny_tokenizer())


def weights(model_dir):
    return f"{model_dir}/model.safetensors"


def truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def empty(path):
    open(path, "wb").close()


def nan_weights(path):
    state = load_file(path)
    name = sorted(state)[0]
    state[name] = state[name].clone()
    state[name].view(-1)[:4] = float("nan")
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.parametrize("damage, words", [
    (truncate, ["damaged", "export or download"]),
    (empty, ["damaged"]),
    (nan_weights, ["non-finite", "damaged"]),
])
def test_damaged_weights_are_one_error_line(model_dir, damage, words):
    damage(weights(model_dir))
    with pytest.raises(UserError) as e:
        load_causal_lm(model_dir, torch.float32, CPU, "draft")
    message = str(e.value)
    assert "\n" not in message and "draft" in message
    for word in words:
        assert word in message


def test_missing_weights_and_config_are_named(model_dir):
    import os

    os.remove(weights(model_dir))
    with pytest.raises(UserError, match="has no weights .model.safetensors."):
        load_causal_lm(model_dir, torch.float32, CPU, "target")
    os.remove(f"{model_dir}/config.json")
    with pytest.raises(UserError, match="has no config.json"):
        load_causal_lm(model_dir, torch.float32, CPU, "target")


def test_intact_model_loads(model_dir):
    model = load_causal_lm(model_dir, torch.float64, CPU, "target")
    assert model.dtype == torch.float64 and not model.training
