"""Analyse a run's per-rank torch.profiler traces: where each rank's step time goes, as report.json + index.html.
It opens with a verdict: compute / communication / idle / data shares, the top kernels, and the lever to try first.

    python tools/analyze_traces.py logs/run/traces                 # -> logs/run/trace_report/index.html
    python tools/analyze_traces.py logs/run/traces -o /tmp/report --no-hta

GPU traces go through HTA (pip install 'megatron_ext[traces]'): temporal, kernel, overlap, idle and annotation
views. CPU traces, or a machine without HTA, get the same sections from the host events: time per labelled region,
communication vs compute vs idle, idle gaps by region, top ops by self time, pipeline bubble for PP runs. The report
says which path ran and why. It may not go inside the trace directory: HTA reads every json/gz file there.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.flag_types import Parser  # noqa: E402 (one-line errors)


def parse(argv=None):
    p = Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("trace_dir", help="directory of rank<N>_trace.json[.gz] files")
    p.add_argument("-o", "--output", default=None, help="report directory (default: <trace_dir>/../trace_report); "
                   "its report.json and index.html are overwritten")
    p.add_argument("--no-hta", action="store_true", help="the CPU path even when HTA and GPU kernels are there")
    p.add_argument("--top", type=int, default=15, help="operations (or kernels) per rank in the top table")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    from megatron_ext.errors import ConfigError
    from analysis.trace_analysis import analyze
    from analysis.trace_report import write_report
    from analysis.traces import outside

    if args.top < 1:
        raise ConfigError(f"--top {args.top}: must be at least 1")
    trace_dir = args.trace_dir.rstrip("/") or "/"
    default = os.path.join(os.path.dirname(os.path.abspath(trace_dir)), "trace_report")
    out = outside(args.output or default, trace_dir, "-o")
    result = analyze(trace_dir, use_hta=not args.no_hta, top_n=args.top)
    _, html_path = write_report(result, out)
    from analysis.trace_verdict import lines

    for line in lines(result["verdict"], result["path"] == "hta"):
        print(line)
    names = dict(window_ms="window", compute_ms="compute", comm_exposed_ms="exposed comm",
                 non_compute_ms="non-compute", idle_ms="idle")
    for row in result.get("breakdown") or []:
        print(f"rank {row['rank']}: " + ", ".join(f"{name} {row[k]:.1f} ms" for k, name in names.items()
                                                  if row.get(k) is not None))
    print(f"analysis path: {result['path']} ({result['reason']})")
    print(f"report: {html_path}")


if __name__ == "__main__":
    run_main(main)
