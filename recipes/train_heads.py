"""Train Medusa heads on a target (SPEC section 4): Medusa-1, or Medusa-2 with lora.enabled=true.

    accelerate launch recipes/train_heads.py --config recipes/configs/NAME.yaml [key=value ...]
    python recipes/train_heads.py --config recipes/configs/NAME.yaml [key=value ...]

`--help` lists every config key. Bad input prints one `error:` line and exits with status 2.
"""

import os
import sys

from drafttrain.config import config_from_argv
from drafttrain.errors import UserError
from drafttrain.heads.train import HeadsConfig, run_heads_training


def main(argv: list[str] | None = None) -> int:
    try:
        run_heads_training(config_from_argv(HeadsConfig, argv, prog="recipes/train_heads.py"))
    except UserError as e:
        if int(os.environ.get("RANK", "0")) == 0:  # every rank fails alike; say it once
            print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
