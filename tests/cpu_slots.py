"""The machine's cores as slots that pytest-xdist workers share, so two workers never oversubscribe the CPU.

A test holds one slot while it runs (most tests use one core: the test process, or one forked script). Anything
that runs several ranks at once (a multi-rank launch, a torchrun or sbatch subprocess: ``@pytest.mark.cpus(n)``)
trades that slot for ``min(n, SLOTS)`` slots, taken together, and gives them back when done. Waiting goes through
a turnstile, so a worker waiting for every slot is not overtaken by the other's stream of one-slot tests. The
slots are ``flock`` locks on files in a directory the controller names (``MEGATRON_EXT_SLOTS_DIR``): the kernel
releases them when a worker dies. Without xdist (one process runs everything) nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import List

ENV = "MEGATRON_EXT_SLOTS_DIR"
SLOTS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # -n N: one core per worker
_held: List[int] = []  # file descriptors of the slots this process holds


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def _fd(name: str) -> int:
    return os.open(os.path.join(os.environ[ENV], name), os.O_RDWR | os.O_CREAT, 0o644)


def acquire(n: int) -> None:
    """Take ``min(n, SLOTS)`` slots (after giving back any held), waiting behind the turnstile."""
    release()
    if not enabled():
        return
    want = min(max(n, 1), SLOTS)
    turnstile = _fd("turnstile")
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        while len(_held) < want:
            for i in range(SLOTS):
                fd = _fd(f"slot{i}")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                _held.append(fd)
                if len(_held) == want:
                    break
            else:
                time.sleep(0.02)
    finally:
        os.close(turnstile)  # closing the last descriptor drops the lock


def release() -> None:
    while _held:
        os.close(_held.pop())


@contextlib.contextmanager
def using(n: int):
    """Run a block on ``n`` cores: trade this test's one slot for ``n``, then take one back."""
    if n <= 1 or not enabled():
        yield
        return
    acquire(n)
    try:
        yield
    finally:
        acquire(1)
