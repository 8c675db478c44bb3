"""What the tests share: ``ranks`` (run_ranks and the other launches), ``hf_fixtures`` (the random Hugging Face
models, their tensors), ``faults`` (the fault plants), ``patched`` (planted bugs and counters), ``step_checks``, the
workers that tests run as scripts (``*_worker.py``), and ``thread_guard``/``forked_ranks`` (conftest's machinery).

Imported as ``support``: pytest puts tests/ on sys.path (conftest.py lives there); a worker run as a script puts it
there itself (``sys.path[:0] = ...`` at its top)."""

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)


def flag_values(run):
    """A parsed run's option values by flag name (``run.flags()``), read as attributes: what the launcher tests
    compare against their commands."""
    from types import SimpleNamespace

    return SimpleNamespace(**run.flags())
