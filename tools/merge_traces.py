"""Merge the per-rank torch.profiler traces of a run into one Chrome/Perfetto trace, one process row per rank.

    python tools/merge_traces.py logs/run/traces                       # -> logs/run/traces_merged.json.gz
    python tools/merge_traces.py logs/run/traces -o /tmp/merged.json.gz

Reads every rank<N>_trace.json[.gz] in the directory (the rank from the trace's distributedInfo, else the name).
Rows are named "rank 3 (tp1 pp0 dp1) CPU" / "rank 3 GPU 0" and sorted by rank; flow arrows stay within their rank;
all ranks share one clock (Kineto's baseTimeNanoseconds). Open the result in https://ui.perfetto.dev. The output
may not go inside the trace directory: HTA reads every json/gz file there.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.flag_types import Parser  # noqa: E402 (one-line errors)


def parse(argv=None):
    p = Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("trace_dir", help="directory of rank<N>_trace.json[.gz] files")
    p.add_argument("-o", "--output", default=None,
                   help="merged trace (.json.gz or .json; default: <trace_dir>/../traces_merged.json.gz)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    from analysis import traces

    trace_dir = args.trace_dir.rstrip("/") or "/"
    default = os.path.join(os.path.dirname(os.path.abspath(trace_dir)), "traces_merged.json.gz")
    out = traces.outside(args.output or default, trace_dir, "-o")
    loaded = traces.load_traces(trace_dir)
    merged = traces.merge(loaded)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    traces.write_trace(merged, out)
    print(f"merged {len(loaded)} ranks ({len(merged['traceEvents']):,} events) into {out}")


if __name__ == "__main__":
    run_main(main)
