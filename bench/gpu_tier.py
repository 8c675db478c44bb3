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


def outcomes(paths: List[str]) -> Dict[str, dict]:
    """{test id: {"outcome": passed|failed|error|not run, "seconds", "reason"}} from JUnit XML files."""
    tests = {}
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            test_id = f"{case.get('classname', '')}::{case.get('name')}"
            outcome, reason = "passed", None
            for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "not run")):
                found = case.find(tag)
                if found is not None:
                    outcome, reason = name, (found.get("message") or found.text or "").strip().splitlines()[0:1]
                    reason = reason[0] if reason else None
                    break
            tests[test_id] = dict(outcome=outcome, seconds=float(case.get("time", 0)), reason=reason)
    return tests


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", nargs="+", help="pytest --junitxml files of the GPU calls")
    parser.add_argument("--out", default=None, help="JSON to write")
    parser.add_argument("--device", default=None, help="default: this machine's CUDA device name")
    args = parser.parse_args(argv)
    tests = outcomes(args.junit)
    counts = collections.Counter(t["outcome"] for t in tests.values())
    report = dict(device=args.device or device_name(), counts=dict(counts), tests=tests)
    for test_id, t in sorted(tests.items()):
        print(f"{t['outcome']:8} {t['seconds']:7.1f}s  {test_id}" + (f"  ({t['reason']})" if t["reason"] else ""))
    print(f"{report['device']}: " + ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "error", "not run")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if counts["failed"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
