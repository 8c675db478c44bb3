"""What every entry script shares: bad input becomes one line on stderr and exit status 2; a run that cannot go
on (non-finite step under --on-nan stop, a failed collective) one line and exit status 1."""

from __future__ import annotations

import os
import sys
from typing import Callable

from megatron_ext.errors import ConfigError, TrainingStopped


def run_main(main: Callable[[], None]) -> None:
    try:
        main()
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except TrainingStopped as e:
        if e.every_rank or os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
