"""Train Medusa heads on a target (SPEC section 4): Medusa-1, or Medusa-2 with lora.enabled=true.

    accelerate launch recipes/train_heads.py --config recipes/configs/NAME.yaml [key=value ...]
    python recipes/train_heads.py --config recipes/configs/NAME.yaml [key=value ...]

`--help` lists every config key. Bad input prints one `error:` line and exits with status 2.
"""

import sys

from drafttrain.heads.train import HeadsConfig, run_heads_training
from drafttrain.training.common import recipe_main


def main(argv: list[str] | None = None) -> int:
    return recipe_main(HeadsConfig, run_heads_training, argv, prog="recipes/train_heads.py")


if __name__ == "__main__":
    sys.exit(main())
