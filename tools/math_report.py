"""Math accuracy before and after a fine-tune, from two tools/eval_math.py outputs of the same problems.

    python tools/math_report.py --before runs/x/eval_before --after runs/x/eval_after \
        --metrics runs/x/metrics.jsonl --out runs/x

Writes report.json (before and after: accuracy, sample count, Wilson 95% interval; the paired difference and its
95% interval; the problems that flipped either way; the loss curve), report.md and report.png
(megatron_ext/evaluation/report.py says how the intervals are computed).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.flag_types import Parser  # noqa: E402 (one-line errors)


def parse(argv=None):
    p = Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--before", required=True, help="eval_math output of the starting model")
    p.add_argument("--after", required=True, help="eval_math output of the fine-tuned model, same problems")
    p.add_argument("--metrics", default=None, help="the run's metrics.jsonl (the loss curve)")
    p.add_argument("--out", required=True, help="directory for report.json, report.md and report.png")
    return p.parse_args(argv)


def main(argv=None):
    from megatron_ext.evaluation import report as rep

    args = parse(argv)
    report = rep.compare(args.before, args.after, args.metrics)
    paths = rep.write(report, args.out)
    b, a, d = report["before"], report["after"], report["difference"]
    print(f"accuracy {b['accuracy']:.1%} -> {a['accuracy']:.1%} on {a['samples']} problems: {d['value']:+.1%} "
          f"(95% interval {d['ci95'][0]:+.1%} to {d['ci95'][1]:+.1%}; {d['fixed']} fixed, {d['broken']} broken) "
          f"-> {', '.join(paths)}")


if __name__ == "__main__":
    run_main(main)
