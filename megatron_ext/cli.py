"""What every entry script shares: bad input becomes one line on stderr and exit status 2; a run that cannot go
on (non-finite step under --on-nan stop, a failed collective) one line and exit status 1.

Under ``python -m megatron_ext.launch`` (every launcher) a rank does not print that line: it writes it for the
launcher, which prints the first failing rank's line once (megatron_ext/launch.py). There a SIGTERM or SIGUSR1
that reaches a rank before its training loop is held (``hold_stop_signals``): the loop acts on it after its first
step (saves, exits 0) instead of the signal killing a rank still starting, preparing data or scoring a reference."""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable, List

from megatron_ext.errors import ConfigError, PreflightPassed, TrainingStopped

STATUS_DIR = "MEGATRON_EXT_STATUS_DIR"  # megatron_ext.launch's: where a rank says how it failed
HELD: List[str] = []  # the stop signal a rank received before its training loop (hold_stop_signals)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _held(signum, frame) -> None:
    if not HELD:
        HELD.append(signal.Signals(signum).name)
        say(f"megatron_ext: rank {os.environ.get('RANK', '0')} received {HELD[0]} outside the training loop: held "
            "(a loop still to come stops after its first step, saved; a finishing run completes)")


def say(line: str) -> None:
    """One line in one write: the ranks share the launcher's pipe and run unbuffered, where print() writes the text
    and its newline apart, so two ranks saying something at once ran into one line."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def hold_stop_signals() -> None:
    """Under megatron_ext.launch: SIGTERM and SIGUSR1 held until the training loop (which acts on them), and this
    rank marked ready for them (the launcher passes a signal on only to ranks that hold it)."""
    folder = os.environ.get(STATUS_DIR)
    if not folder:
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _held)
    try:
        open(os.path.join(folder, f"ready.{os.getpid()}"), "w").close()
    except OSError:  # the launcher's folder is gone: it is ending
        pass


def _report(code: int, line: str, printed: bool) -> None:
    folder = os.environ.get(STATUS_DIR)
    if folder:
        import json
        import time

        rank = os.environ.get("RANK", "0")
        path = os.path.join(folder, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:  # renamed into place: a rank killed mid-write leaves no half line
            json.dump({"rank": int(rank), "code": code, "line": line, "time": time.time()}, f)
        os.replace(path + ".tmp", path)
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
