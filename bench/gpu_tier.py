"""What the GPU tier proved on this machine: which tests ran and passed, failed, or were not run (and why).

``pytest -m gpu`` passing says nothing about the tests it skipped: on a one-GPU machine every multi-GPU test
(``multigpu``) is skipped. Each GPU call in bench/README.md writes pytest's JUnit XML; this prints a table from them
and writes JSON for ``bench/results/`` with the device name, so a result never reads as more than it is.

    python bench/gpu_tier.py OUT/*.xml --out bench/results/h100_gpu_tier.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import xml.etree.ElementTree as ET
from typing import Dict, List


SEVERITY = {"not run": 0, "passed": 1, "failed": 2, "error": 3}  # a test seen in several files keeps its worst


class EmptyReport(ValueError):
    """A JUnit file without a single test case: pytest never collected what the call meant to run, or was stopped
    before its first test finished."""


def merge(tests: Dict[str, dict], more: Dict[str, dict]) -> Dict[str, dict]:
    """``tests`` with ``more`` added, a test in both keeping its worst outcome (a failure is never overwritten by a
    later "not run" or "passed")."""
    tests = dict(tests)
    for test_id, t in more.items():
        if test_id not in tests or SEVERITY[t["outcome"]] > SEVERITY[tests[test_id]["outcome"]]:
            tests[test_id] = t
    return tests


def outcomes(paths: List[str]) -> Dict[str, dict]:
    """{test id: {"outcome": passed|failed|error|not run, "seconds", "reason"}} from JUnit XML files, merged (a test
    in several files keeps its worst outcome); a file with no test case raises EmptyReport. A nameless case is
    pytest's mark of a run stopped (SIGINT) before its first test finished, not a test."""
    tests = {}
    for path in paths:
        every = list(ET.parse(path).getroot().iter("testcase"))
        cases = [case for case in every if case.get("name")]
        if not cases:
            raise EmptyReport(f"{path} holds no test case: " + ("pytest was stopped before its first test finished"
                              if every else "pytest collected nothing (a wrong test id or marker?)"))
        found = {}
        for case in cases:
            outcome, reason = "passed", None
            for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "not run")):
                element = case.find(tag)
                if element is not None:
                    outcome, reason = name, (element.get("message") or element.text or "").strip().splitlines()[0:1]
                    reason = reason[0] if reason else None
                    break
            found[f"{case.get('classname', '')}::{case.get('name')}"] = dict(
                outcome=outcome, seconds=float(case.get("time", 0)), reason=reason)
        tests = merge(tests, found)
    return tests


def expected(tests: Dict[str, dict], ids: List[str], reason: str) -> Dict[str, dict]:
    """``tests`` with every pytest node id of ``ids`` (``path.py::name``, ``name`` standing for all its parameters)
    that it lacks added as "not run" for ``reason`` (a run stopped at its cap reports only what finished)."""
    tests = dict(tests)
    for node in ids:
        path, _, name = node.partition("::")
        test_id = f"{path[:-3].replace('/', '.')}::{name}"
        if not any(t == test_id or t.startswith(test_id + "[") for t in tests):
            tests[test_id] = dict(outcome="not run", seconds=0.0, reason=reason)
    return tests


def summary(tests: Dict[str, dict], device: str) -> dict:
    """The tier's report: device, counts per outcome, every test's outcome; ``ok`` when nothing failed."""
    counts = collections.Counter(t["outcome"] for t in tests.values())
    return dict(device=device, counts=dict(counts), ok=not (counts["failed"] or counts["error"]), tests=tests)


def report(paths: List[str], device: str) -> dict:
    """``summary`` of the JUnit files ``paths``."""
    return summary(outcomes(paths), device)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", nargs="+", help="pytest --junitxml files of the GPU calls")
    parser.add_argument("--out", default=None, help="JSON to write")
    parser.add_argument("--device", default=None, help="default: this machine's CUDA device name")
    args = parser.parse_args(argv)
    try:
        tier = report(args.junit, args.device or device_name())
    except (EmptyReport, ET.ParseError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    counts = collections.Counter(tier["counts"])
    for test_id, t in sorted(tier["tests"].items()):
        print(f"{t['outcome']:8} {t['seconds']:7.1f}s  {test_id}" + (f"  ({t['reason']})" if t["reason"] else ""))
    print(f"{tier['device']}: " + ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "error", "not run")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(tier, f, indent=1)
    return 0 if tier["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
