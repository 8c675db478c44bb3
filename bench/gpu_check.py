"""One GPU window, one command: bench/gpu_queue.py's queue in priority order within a budget, whatever happens.

    python3 bench/gpu_check.py --wheels .whl --out $OUT --work /tmp/gpu_check     # the GPU machine (bench/README.md)
    .venv/bin/python bench/gpu_check.py --rehearse --out /tmp/rehearsal          # here, on CPU, before the window

The env entry runs first (the device and versions: the ledger's key), then a parse of every benchmark command line
(``gpu_stages.py probe``), then each entry of ``gpu_queue.QUEUE`` in order, unless it is measured on this device and
versions (``bench/results/gpu_queue.json``; ``--force`` reruns), its flags are not there yet, it needs CUDA on a CPU,
or its expected seconds do not fit what is left ("not reached": a later, smaller entry may still run). Each entry is
its own process (``bench/gpu_stages.py``) under its own cap: at the cap it gets SIGINT (pytest still writes its
JUnit), ``GRACE`` seconds later SIGKILL with everything it started; it is recorded ``timed_out`` and the queue goes
on. After every entry ``OUT/gpu_check.json``, ``OUT/gpu_check.md`` and the updated ledger ``OUT/gpu_queue.json`` are
rewritten, so at any moment they hold every finished entry; ``OUT/gpu_check.log`` has every entry's output. Four
files: a device call brings back at most eight. The report ends each window with issue 64's targets
(``gpu_queue.TARGETS``): met or missed only from rows this window measured. A rehearsal reads and writes its ledger
in OUT only. Standard library only, so it runs before the wheels are installed (by ``--wheels``, timed for the env
entry).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from table import grid  # noqa: E402 (bench/, beside this script: standard library only)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import gpu_queue  # noqa: E402 (beside this script: standard library only)
from gpu_queue import QUEUE  # noqa: E402

GRACE = {False: 10, True: 3}  # SIGINT, then this long before SIGKILL
MIN_STAGE = {False: 20, True: 3}
RESERVE = 2  # seconds kept for the last report
PROBE_S = 30


def cap(expect: float, rehearse: bool) -> float:
    """An entry's cap from its expected seconds: room for a slow start (cold imports, compiles; 2026-11-27)."""
    return 3 * expect + 20 if rehearse else 1.2 * expect + 10


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


def chosen(entry_id: str, names) -> bool:
    """``entry_id`` is one of ``names`` or under one (``speed`` names every ``speed.*``)."""
    return any(entry_id == n or entry_id.startswith(n + ".") for n in names or ())


def decide(entry, args, left: float, expect, state: dict):
    """(status, note) for an entry not to run now, or None to run it."""
    if entry.id == "env":
        return None  # the ledger's key: always
    done = None if chosen(entry.id, args.force) else gpu_queue.measured(entry.id, state["found"])
    if done:
        return "skipped", f"measured {done['date']} ({done['headline']})"
    refused = state["refused"].get(entry.id)
    if refused and entry.needs:
        return "skipped", f"needs {entry.needs} ({refused})"
    if entry.cuda and not state["cuda"]:
        return "skipped", f"needs CUDA: {entry.cuda}"
    if args.only and not chosen(entry.id, args.only):
        return "skipped", "not in --only"
    if refused:
        return "failed", f"refused: {refused}"
    need = max(expect or 0, MIN_STAGE[args.rehearse])
    if left < need:
        return "not reached", f"needs ~{need:.0f} s, {max(left, 0):.0f} s left"
    return None


def record(ledger: dict, state: dict, entry, row: dict, result: str) -> None:
    """The entry's outcome into the ledger under this window's key: what ran (each test of a tests entry on its
    own: passed is measured), and what was not reached or lacks a flag (never over a measurement)."""
    info = state["info"]
    run = ledger["runs"].setdefault(state["key"], dict(
        device=info.get("device"), versions={v: info.get(v) for v in gpu_queue.VERSIONS}, entries={}))
    entries, day = run["entries"], time.strftime("%Y-%m-%d", time.gmtime())

    def put(entry_id, status, headline, spec=""):
        entries[entry_id] = dict(status=status, date=day, headline=headline, result=result, spec=spec)

    headline = (row["results"] or {}).get("headline") or row["note"]
    if row.get("ran") and entry.stage == "tests":
        for t in (row["results"] or {}).get("rows", []):
            if t["outcome"] != "not run":
                put(gpu_queue.node_id(t["test"]), "measured" if t["outcome"] == "passed" else t["outcome"], t["reason"])
    if row.get("ran") and entry.id not in ("env", "correctness"):
        put(entry.id, "measured" if row["status"] == "passed" else row["status"], headline, gpu_queue.spec(entry))
    elif not row.get("ran") and row["note"] != "not in --only" and not row["note"].startswith("measured") \
            and not gpu_queue.measured(entry.id, entries):
        put(entry.id, row["status"], headline)


def summary(rows: list) -> dict:
    """The report's four lists: run this time, skipped as measured, not reached (budget), skipped (why)."""
    out = {"run": [], "skipped as measured": [], "not reached": [], "skipped": []}
    for r in rows:
        kind = "run" if r.get("ran") else "skipped as measured" if r["note"].startswith("measured") else \
            "not reached" if r["status"] == "not reached" else "skipped"
        out[kind].append(r["id"] + ("" if kind != "run" else f" ({r['status']})")
                         + (f" ({r['note']})" if kind == "skipped" else ""))
    return out


def write_report(out: str, report: dict) -> None:
    """gpu_check.json and gpu_check.md, each written whole then renamed."""
    report["summary"] = summary(report["entries"])
    rows = {r["id"]: r for r in report["entries"]}
    report["targets"] = [dict(target=t.what, verdict=v, evidence=e, entry=t.entry) for t in gpu_queue.TARGETS
                         for v, e in [gpu_queue.judge(t, rows.get(t.entry), report["rehearse"])]]
    lines = [f"# GPU check: {report['device']}", "",
             f"{report['date']}; budget {report['budget_s']} s, wall {report['wall_s']} s"
             + (" (rehearsal on CPU: tiny shapes, GPU tests skipped)" if report["rehearse"] else "")
             + f"; ledger key `{report['key']}`", ""]
    lines += [f"- {kind}: " + (", ".join(ids) or "none") for kind, ids in report["summary"].items()] + [""]
    lines += ["## Targets (issue 64: met only where this window measured them)", ""] + markdown(
        report["targets"]) + [""]
    lines += markdown([dict(entry=r["id"], status=r["status"], seconds=r["seconds"], expect_s=r["expect_s"],
                            cap_s=r["cap_s"], result=(r["results"] or {}).get("headline") or r["note"])
                       for r in report["entries"]])
    for r in report["entries"]:
        rows = (r["results"] or {}).get("rows") or []
        if rows:
            lines += ["", f"## {r['id']} ({r['status']}, {r['seconds']} s)", ""] + markdown(rows)
    for name, text in (("json", json.dumps(report, indent=1, default=str)), ("md", "\n".join(lines) + "\n")):
        path = os.path.join(out, f"gpu_check.{name}")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="gpu_check.json, gpu_check.md, gpu_check.log and the updated ledger "
                   "gpu_queue.json go here")
    p.add_argument("--work", default=None, help="the entries' own files (default OUT/work; on the device machine "
                   "somewhere outside $OUT, which brings back at most eight files)")
    p.add_argument("--budget", type=float, default=590, help="seconds for everything, the wheel install included")
    p.add_argument("--wheels", default=None, help="install these prepared wheels first (the env entry times it)")
    p.add_argument("--rehearse", action="store_true", help="every entry on CPU with tiny shapes, same plumbing; the "
                   "ledger is OUT/gpu_queue.json")
    p.add_argument("--ledger", default=gpu_queue.LEDGER, help="what is measured where (read; the update goes to OUT)")
    p.add_argument("--simulate-hang", default=None, metavar="ID",
                   help="that entry hangs (deaf to SIGINT): proves its cap, the later entries and the budget")
    p.add_argument("--only", nargs="+", default=None, metavar="ID", help="run only these (and env); an ID names the "
                   "entries under it too (speed: speed.*)")
    p.add_argument("--force", nargs="+", default=[], metavar="ID", help="run these even if measured")
    p.add_argument("--cap", nargs="+", default=[], metavar="ID=SECONDS", help="override entries' caps")
    args = p.parse_args(argv)
    for name in [args.simulate_hang or "env", *(args.only or ()), *args.force]:
        if not any(chosen(e.id, [name]) for e in QUEUE):
            p.error(f"{name}: no such entry (bench/gpu_queue.py: {', '.join(e.id for e in QUEUE)})")
    args.caps = {}
    for item in args.cap:
        name, _, seconds = item.partition("=")
        if name not in gpu_queue.BY_ID or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--cap {item}: expected ID=SECONDS with ID one of {', '.join(gpu_queue.BY_ID)}")
        args.caps[name] = float(seconds)
    return args


def after_env(args, state: dict, work: str, env: dict, log, deadline: float) -> None:
    """The device and versions (the ledger's key), CUDA or not, and which command lines the scripts refuse."""
    info = (stage_results(os.path.join(work, "env.json")) or {}).get("info") or {}
    state.update(info=info, key=gpu_queue.key(info), cuda=info.get("gpus", 0) > 0 if info else not args.rehearse)
    state["found"] = gpu_queue.records(state["ledger"], state["key"])
    left = deadline - time.monotonic()
    if left > MIN_STAGE[args.rehearse]:
        cmd = [sys.executable, os.path.join(REPO, "bench", "gpu_stages.py"), "probe", "--work", work]
        print("\n=== probe: every benchmark command line against its script's parser ===", file=log, flush=True)
        if run_stage(cmd + ["--rehearse"] * args.rehearse, min(PROBE_S, left), GRACE[args.rehearse], env, log) \
                == "passed":
            state["refused"] = {k: v for k, v in stage_results(os.path.join(work, "probe.json")).items() if v}


def main(argv=None) -> int:
    args = parse(argv)
    start = time.monotonic()
    deadline = start + args.budget - RESERVE
    work = args.work or os.path.join(args.out, "work")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    shutil.rmtree(os.path.join(work, "bench"), ignore_errors=True)  # benchmark JSON is shared within one window only
    ledger_path = os.path.join(args.out, "gpu_queue.json") if args.rehearse else args.ledger
    state = dict(ledger=gpu_queue.load(ledger_path), info={}, key=gpu_queue.key({}), found={}, refused={},
                 cuda=not args.rehearse, ran=set())
    report = dict(device="unknown", key=state["key"], date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  budget_s=args.budget, wall_s=0.0, rehearse=args.rehearse, command=" ".join(sys.argv),
                  ledger=ledger_path, entries=[])
    # (no training.png: matplotlib's first import on a fresh GPU machine is seconds of a stage's cap)
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEGATRON_EXT_PLOT="0", PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    with open(os.path.join(args.out, "gpu_check.log"), "a", buffering=1) as log:
        for entry in QUEUE:
            left = deadline - time.monotonic()
            expect = gpu_queue.expected(entry, args.rehearse, state["found"], state["ran"])
            row = dict(id=entry.id, status="skipped", seconds=0.0, expect_s=expect, cap_s=None, note="", results=None)
            verdict = decide(entry, args, left, expect, state)
            if verdict:
                row["status"], row["note"] = verdict
            else:
                limit = args.caps.get(entry.id) or (cap(expect, args.rehearse) if expect else left)
                row.update(ran=True, cap_s=round(max(min(limit, left), 1), 1))
                began = time.monotonic()
                print(f"\n=== {entry.id} (cap {row['cap_s']:.0f} s) ===", file=log, flush=True)
                if entry.id == "env" and args.wheels:
                    site = os.path.join(work, "site")
                    try:
                        env["GPU_CHECK_INSTALL_S"] = f"{install(args.wheels, site, log):.1f}"
                    except subprocess.CalledProcessError as e:  # the env entry still says what is there
                        env["GPU_CHECK_INSTALL_S"] = f"failed (pip exited {e.returncode}: gpu_check.log)"
                    except SystemExit as e:
                        env["GPU_CHECK_INSTALL_S"] = f"failed ({e})"
                    env["PYTHONPATH"] = os.pathsep.join([site, env["PYTHONPATH"]])
                if entry.stage == "tests":  # its tests measured here before are not run again
                    found = state["found"]
                    done = [] if chosen(entry.id, args.force) else [t for t in found if "::" in t
                                                                    and gpu_queue.measured(t, found)]
                    with open(os.path.join(work, "measured.json"), "w") as f:
                        json.dump(done, f)
                cmd = [sys.executable, os.path.join(REPO, "bench", "gpu_stages.py"), entry.id, "--work", work]
                cmd += ["--rehearse"] * args.rehearse + ["--hang"] * (args.simulate_hang == entry.id)
                row["status"] = run_stage(cmd, row["cap_s"] - (time.monotonic() - began), GRACE[args.rehearse],
                                          env, log)
                row["seconds"] = round(time.monotonic() - began, 1)
                row["results"] = stage_results(os.path.join(work, f"{entry.id}.json"))
                found = row["results"] or {}
                found = found.get("info", {}).get("device") or found.get("device")  # env's, else a benchmark's
                if found and report["device"] == "unknown":
                    report["device"] = found
                if row["status"] == "passed":
                    state["ran"].add(entry.id)
            if entry.id == "env":
                after_env(args, state, work, env, log, deadline)
                report.update(key=state["key"], refused=state["refused"])
            slug = report["device"].split(" (")[0].lower().replace(" ", "-")
            result = os.path.join(args.out, "gpu_check.json") if args.rehearse else \
                f"bench/results/{slug}_gpu_check_{report['date'][:10]}.json"
            report["commit"] = f"cp OUT/gpu_queue.json {os.path.relpath(gpu_queue.LEDGER, REPO)}; " \
                f"cp OUT/gpu_check.json {result}; cp OUT/gpu_check.md {result[:-5]}.md"
            record(state["ledger"], state, entry, row, result)
            gpu_queue.save(os.path.join(args.out, "gpu_queue.json"), state["ledger"])
            report["entries"].append(row)
            report["wall_s"] = round(time.monotonic() - start, 1)
            write_report(args.out, report)
            print(f"{entry.id:32} {row['status']:11} {row['seconds']:6.1f} s  "
                  f"{(row['results'] or {}).get('headline') or row['note']}", flush=True)
    for t in report["targets"]:
        print(f"target  {t['verdict']:10}  {t['target']}: {t['evidence']}")
    print(f"wrote {os.path.join(args.out, 'gpu_check.json')}, gpu_check.md and gpu_queue.json ({report['wall_s']} s)"
          + ("" if args.rehearse else f"; to commit: {report['commit']}"))
    return 0 if all(r["status"] not in ("failed", "timed_out") for r in report["entries"]) else 1


if __name__ == "__main__":
    sys.exit(main())
