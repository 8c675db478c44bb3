"""What every entry script shares: bad input becomes one line on stderr and exit status 2; a run that cannot go
on (non-finite step under --on-nan stop, a failed collective) one line and exit status 1.

Under ``python -m megatron_ext.launch`` (every launcher) a rank does not print that line: it writes it for the
launcher, which prints the first failing rank's line once (megatron_ext/launch.py)."""

from __future__ import annotations

import os
import sys
from typing import Callable

from megatron_ext.errors import ConfigError, PreflightPassed, TrainingStopped

STATUS_DIR = "MEGATRON_EXT_STATUS_DIR"  # megatron_ext.launch's: where a rank says how it failed


def _report(code: int, line: str, printed: bool) -> None:
    folder = os.environ.get(STATUS_DIR)
    if folder:
        import json
        import time

        rank = os.environ.get("RANK", "0")
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": int(rank), "code": code, "line": line, "time": time.time()}, f)
    elif printed:
        print(f"error: {line}", file=sys.stderr, flush=True)


def run_main(main: Callable[[], None]) -> None:
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        main()
    except PreflightPassed:
        sys.exit(0)
    except ConfigError as e:
        _report(2, str(e), rank0)
        sys.exit(2)
    except TrainingStopped as e:
        _report(1, str(e), e.every_rank or rank0)
        sys.exit(1)
    except Exception as e:  # a stack trace (Python prints it); the launcher names it last
        _report(1, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''} (traceback above)",
                False)
        raise
