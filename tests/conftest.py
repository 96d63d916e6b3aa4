import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # `import tiny` from every test directory
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # `import recipes.distill`: the recipes are scripts
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tiny models gain nothing from intra-op threads; one thread keeps timings steady when
# several test processes share the machine's two cores.
torch.set_num_threads(1)
