import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # `import tiny` from every test directory
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # `import recipes.distill`: the recipes are scripts
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models gain nothing from intra-op threads; one thread keeps timings steady when
# several test processes share the machine's two cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps process-wide singletons; each in-process recipe run starts from a clean slate."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
