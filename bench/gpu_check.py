"""One GPU window, one command: correctness, speed beside transformers, MoE, ViT and a profile, whatever happens.

    python3 bench/gpu_check.py --wheels .whl --out $OUT --work /tmp/gpu_check     # the GPU machine (bench/README.md)
    .venv/bin/python bench/gpu_check.py --rehearse --out /tmp/rehearsal          # here, on CPU, before the window

Stages run in order (``STAGES``), each its own process (``bench/gpu_stages.py``) under its own cap: at the cap it
gets SIGINT (pytest still writes its JUnit), ``GRACE`` seconds later SIGKILL with everything it started; it is
recorded ``timed_out`` and the next stage runs while the budget lasts. A stage that could not get ``MIN_STAGE``
seconds is ``skipped``. After every stage ``OUT/gpu_check.json`` and ``OUT/gpu_check.md`` are rewritten, so at any
moment they hold every finished stage; ``OUT/gpu_check.log`` has every stage's output. Three files: a device call
brings back at most eight. Standard library only, so it runs before the wheels are installed (by ``--wheels``, timed
for the env stage).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time

from table import grid  # noqa: E402 (bench/, beside this script: standard library only)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (stage, cap in seconds on a GPU, in a rehearsal); None: whatever the budget has left. The GPU caps fill 590 s. A
# stage gets SIGINT GRACE seconds before its cap. The H200 windows (bench/results/nvidia-h200_gpu_check*.md) set
# them: a cold `import torch` past 10 s (env), the deciding tests ~150 s in their order with the MoE runs together
# (correctness), three speed runs ~110 s and a fourth ~25 s, moe_layer 43 s, vit 38 s, profile 35 s, verify 55 s.
STAGES = [("env", 40, 40), ("correctness", 195, 40), ("speed_qwen", 140, 80), ("moe_layer", 50, 30), ("vit", 50, 30),
          ("profile", 45, 40), ("verify", 70, 40), ("rest", None, None)]
GRACE = {False: 10, True: 3}  # SIGINT, then this long before SIGKILL
MIN_STAGE = {False: 20, True: 3}
RESERVE = 2  # seconds kept for the last report


def install(wheels: str, site: str, log) -> float:
    """pip-install the prepared wheels into ``site`` (no index, no dependencies: prepare_wheels.sh names them all)."""
    start = time.monotonic()
    files = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if not files:
        raise SystemExit(f"error: --wheels {wheels}: no .whl files (run bash ../shared/gpu/prepare_wheels.sh first)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", site, *files], check=True, stdout=log, stderr=log)
    return time.monotonic() - start


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_stage(cmd: list, cap: float, grace: float, env: dict, log) -> str:
    """passed / failed / timed_out; whatever the stage started is gone when this returns."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        status = "passed" if proc.wait(timeout=max(cap - grace, 1)) == 0 else "failed"
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        status = "timed_out"
    _kill_group(proc.pid, signal.SIGKILL)  # also a finished stage's leftovers
    proc.wait()
    return status


def stage_results(path: str):
    """What the stage wrote (None if nothing; a note if it is not JSON: written whole, so it should not happen)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return dict(headline=f"unreadable results: {e}", rows=[])


def markdown(rows: list) -> list:
    """Rows of dicts as a table, a column per key in order of appearance."""
    if not rows:
        return []
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return grid(cols, [["" if r.get(c) is None else r[c] for c in cols] for r in rows])


def write_report(out: str, report: dict) -> None:
    """gpu_check.json and gpu_check.md, each written whole then renamed."""
    lines = [f"# GPU check: {report['device']}", "",
             f"{report['date']}; budget {report['budget_s']} s, wall {report['wall_s']} s"
             + (" (rehearsal on CPU: tiny shapes, GPU tests skipped)" if report["rehearse"] else ""), ""]
    lines += markdown([dict(stage=s["name"], status=s["status"], seconds=s["seconds"], cap_s=s["cap_s"],
                            result=(s["results"] or {}).get("headline") or s.get("note") or "")
                       for s in report["stages"]])
    for s in report["stages"]:
        rows = (s["results"] or {}).get("rows") or []
        if rows:
            lines += ["", f"## {s['name']} ({s['status']}, {s['seconds']} s)", ""] + markdown(rows)
    for name, text in (("json", json.dumps(report, indent=1, default=str)), ("md", "\n".join(lines) + "\n")):
        path = os.path.join(out, f"gpu_check.{name}")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="gpu_check.json, gpu_check.md and gpu_check.log go here")
    p.add_argument("--work", default=None, help="the stages' own files (default OUT/work; on the device machine "
                   "somewhere outside $OUT, which brings back at most eight files)")
    p.add_argument("--budget", type=float, default=590, help="seconds for everything, the wheel install included")
    p.add_argument("--wheels", default=None, help="install these prepared wheels first (the env stage times it)")
    p.add_argument("--rehearse", action="store_true", help="every stage on CPU with tiny shapes, same plumbing")
    p.add_argument("--simulate-hang", default=None, choices=[s for s, _, _ in STAGES],
                   help="that stage hangs (deaf to SIGINT): proves its cap, the later stages and the budget")
    p.add_argument("--only", nargs="+", default=None, choices=[s for s, _, _ in STAGES], help="run only these")
    p.add_argument("--cap", nargs="+", default=[], metavar="STAGE=SECONDS", help="override stages' caps")
    args = p.parse_args(argv)
    names = [s for s, _, _ in STAGES]
    caps = {}
    for item in args.cap:
        stage, _, seconds = item.partition("=")
        if stage not in names or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--cap {item}: expected STAGE=SECONDS with STAGE one of {', '.join(names)}")
        caps[stage] = float(seconds)
    args.caps = caps
    return args


def main(argv=None) -> int:
    args = parse(argv)
    start = time.monotonic()
    deadline = start + args.budget - RESERVE
    work = args.work or os.path.join(args.out, "work")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    report = dict(device="unknown", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), budget_s=args.budget,
                  wall_s=0.0, rehearse=args.rehearse, command=" ".join(sys.argv), stages=[])
    # (no training.png: matplotlib's first import on a fresh GPU machine is seconds of a stage's cap)
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEGATRON_EXT_PLOT="0", PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    grace, shortest = GRACE[args.rehearse], MIN_STAGE[args.rehearse]
    with open(os.path.join(args.out, "gpu_check.log"), "a", buffering=1) as log:
        for name, gpu_cap, rehearse_cap in STAGES:
            left = deadline - time.monotonic()
            cap = args.caps.get(name, rehearse_cap if args.rehearse else gpu_cap) or left
            cap = min(cap, left)
            entry = dict(name=name, status="skipped", seconds=0.0, cap_s=round(cap, 1), results=None)
            if args.only and name not in args.only:
                entry["note"] = "not in --only"
            elif cap < shortest:
                entry["note"] = f"budget spent ({max(left, 0):.0f} s left)"
            else:
                began = time.monotonic()
                print(f"\n=== {name} (cap {cap:.0f} s) ===", file=log, flush=True)
                if name == "env" and args.wheels:
                    site = os.path.join(work, "site")
                    try:
                        env["GPU_CHECK_INSTALL_S"] = f"{install(args.wheels, site, log):.1f}"
                    except subprocess.CalledProcessError as e:  # the env stage still says what is there
                        env["GPU_CHECK_INSTALL_S"] = f"failed (pip exited {e.returncode}: gpu_check.log)"
                    except SystemExit as e:
                        env["GPU_CHECK_INSTALL_S"] = f"failed ({e})"
                    env["PYTHONPATH"] = os.pathsep.join([site, env["PYTHONPATH"]])
                cmd = [sys.executable, os.path.join(REPO, "bench", "gpu_stages.py"), name, "--work", work]
                cmd += ["--rehearse"] * args.rehearse + ["--hang"] * (args.simulate_hang == name)
                entry["status"] = run_stage(cmd, cap - (time.monotonic() - began), grace, env, log)
                entry["seconds"] = round(time.monotonic() - began, 1)
                entry["results"] = stage_results(os.path.join(work, f"{name}.json"))
                found = entry["results"] or {}
                found = found.get("info", {}).get("device") or found.get("device")  # env's, else a benchmark's
                if found and report["device"] == "unknown":
                    report["device"] = found
            report["stages"].append(entry)
            report["wall_s"] = round(time.monotonic() - start, 1)
            write_report(args.out, report)
            print(f"{name:12} {entry['status']:9} {entry['seconds']:6.1f} s  "
                  f"{(entry['results'] or {}).get('headline') or entry.get('note') or ''}", flush=True)
    print(f"wrote {os.path.join(args.out, 'gpu_check.json')} and gpu_check.md ({report['wall_s']} s)")
    return 0 if all(s["status"] in ("passed", "skipped") and "budget" not in s.get("note", "")
                    for s in report["stages"]) else 1


if __name__ == "__main__":
    sys.exit(main())
