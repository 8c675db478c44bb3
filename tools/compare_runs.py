"""Compare training runs: throughput, speedup and scaling efficiency, MFU, memory, step split and loss, in one report.

    python tools/compare_runs.py runs/dp_1gpu runs/dp_2gpu runs/dp_4gpu -o report/
    python tools/compare_runs.py runs/ddp:DDP runs/z2:ZeRO-2 runs/z3:ZeRO-3 --gpus 4,4,4 -o report/

Each argument is a training run's --log-dir (metrics.jsonl, and summary.json when the run finished), optionally
with :LABEL. Writes report/comparison.json, report/index.html (self-contained) and a PNG per plot, and prints a
markdown table. Speedup and efficiency are against the run on the fewest devices (or --baseline), and only for runs
that did the same work per step (tokens) on the same model; the table says why the others are not comparable.
Device counts come from --gpus, else summary.json's "run" (new runs write it), else "_<N>gpu" in the directory name.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.flag_types import Parser  # noqa: E402 (one-line errors)


def parse(argv=None):
    p = Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("runs", nargs="*", metavar="DIR[:LABEL]", help="a run's --log-dir, optionally with a label")
    p.add_argument("-o", "--output", default=None,
                   help="report directory (default: comparison/ beside the first run, e.g. runs/comparison); "
                        "comparison.json, index.html and the PNGs there are overwritten, other files left alone")
    p.add_argument("--gpus", default=None, help="device count of each run, in order, comma-separated (e.g. 1,2,4; "
                   "'-' keeps a run's own); overrides what the run recorded")
    p.add_argument("--baseline", default=None, metavar="LABEL",
                   help="the run speedups are measured against (default: the one on the fewest devices)")
    return p.parse_args(argv)


def device_counts(text):
    from megatron_ext.errors import ConfigError

    if text is None:
        return None
    counts = []
    for item in text.split(","):
        item = item.strip()
        if item == "-":
            counts.append(None)
        elif item.isdigit() and int(item) > 0:
            counts.append(int(item))
        else:
            raise ConfigError(f"--gpus {text}: {item!r} is not a device count (a positive integer, or '-')")
    return counts  # load_runs checks there is one per run


def main(argv=None):
    args = parse(argv)
    from megatron_ext.errors import ConfigError
    from analysis.compare import compare, load_runs, markdown, split_label
    from analysis.compare_report import write_report

    runs = load_runs(args.runs, device_counts(args.gpus))
    if args.output is None:  # beside the runs, never into the repository or wherever the shell happens to be
        args.output = os.path.join(os.path.dirname(os.path.abspath(split_label(args.runs[0])[0])), "comparison")
    out = os.path.realpath(args.output)
    for spec in args.runs:
        directory = split_label(spec)[0]
        if os.path.realpath(directory) == out:
            raise ConfigError(f"-o {args.output} is the run directory {directory}; write the report elsewhere")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"-o {args.output} is a file; give a directory for the report")
    result = compare(runs, args.baseline)
    html_path = write_report(result, runs, args.output)
    print(markdown(result))
    print(f"report: {html_path}")


if __name__ == "__main__":
    run_main(main)
