"""How many threads this process holds: the test runner's guard (conftest.py) and the multi-rank workers check it
after every test or layout. gloo's run-loop threads are native, so ``threading.active_count`` does not see them."""

import collections
import os
import threading

LIMIT = 100  # threads a test process or a worker rank may hold at any point
SLACK = 8  # what one test may add for good (torch's intra-op pool, a logging thread started once)


def count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: Python's threads only
        return threading.active_count()


def names() -> collections.Counter:
    """Threads by name (``/proc``'s comm: gloo's are ``pt_gloo_runloop`` and ``gloo_tcp_loop``)."""
    found = collections.Counter()
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                found[f.read().strip()] += 1
        except OSError:  # it ended meanwhile
            pass
    return found


def grown(before: collections.Counter) -> str:
    """What was added since ``before``, by name: ``pt_gloo_runloop +6, gloo_tcp_loop +3``."""
    return ", ".join(f"{name} +{k}" for name, k in (names() - before).most_common())


def check(where: str) -> int:
    """Raise when this process holds more than ``LIMIT`` threads; returns the count."""
    held = count()
    if held > LIMIT:
        raise RuntimeError(f"{held} threads after {where} (limit {LIMIT}): a process group was left alive")
    return held
