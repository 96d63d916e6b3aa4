"""Distill a draft model from a target (SPEC section 4).

    accelerate launch recipes/distill.py --config recipes/configs/NAME.yaml [key=value ...]
    python recipes/distill.py --config recipes/configs/NAME.yaml [key=value ...]

`--help` lists every config key. Bad input prints one `error:` line and exits with status 2.
"""

import sys

from drafttrain.training.common import recipe_main
from drafttrain.training.distill import DistillConfig, run_distillation


def main(argv: list[str] | None = None) -> int:
    return recipe_main(DistillConfig, run_distillation, argv, prog="recipes/distill.py")


if __name__ == "__main__":
    sys.exit(main())
