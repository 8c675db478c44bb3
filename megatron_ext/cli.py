"""What every entry script shares: bad input becomes one line on stderr and exit status 2; a run that cannot go
on (non-finite step under --on-nan stop, a failed collective) one line and exit status 1."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Callable

from megatron_ext.errors import ConfigError, TrainingStopped


# megatron-core warns at import time, once per module, that optional TE/apex kernels are absent; on CPU that is
# the expected state, and README's table says what they add on GPU.
NOISE = r".*(Transformer Engine|Apex|apex).*(not installed|Falling back).*"


def run_main(main: Callable[[], None]) -> None:
    warnings.filterwarnings("ignore", message=NOISE, category=UserWarning)
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
