"""Distill a draft model from a target (SPEC section 4).

    accelerate launch recipes/distill.py --config recipes/configs/NAME.yaml [key=value ...]
    python recipes/distill.py --config recipes/configs/NAME.yaml [key=value ...]

`--help` lists every config key. Bad input prints one `error:` line and exits with status 2.
"""

import os
import sys

from drafttrain.config import config_from_argv
from drafttrain.errors import UserError
from drafttrain.training.distill import DistillConfig, run_distillation


def main(argv: list[str] | None = None) -> int:
    try:
        run_distillation(config_from_argv(DistillConfig, argv, prog="recipes/distill.py"))
    except UserError as e:
        if int(os.environ.get("RANK", "0")) == 0:  # every rank fails alike; say it once
            print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
