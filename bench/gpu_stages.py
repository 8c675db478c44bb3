"""The entries of ``bench/gpu_queue.py``'s queue, each its own process: ``python bench/gpu_stages.py ID --work DIR``.

An entry writes what it has so far to ``DIR/ID.json`` after every part (``Results``), so an entry stopped at its cap
still leaves its finished parts; it exits non-zero when a check fails. ``--rehearse`` runs the same commands on CPU
with tiny shapes (``gpu_check.py --rehearse``): every flag, path, JSON field and table is exercised before a GPU
window is spent on them. ``python bench/gpu_stages.py probe --work DIR`` checks every benchmark entry's command line
against its script's parser (no torch import): what a script refuses is skipped, not run.
"""

from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
sys.path.insert(0, os.path.join(REPO, "bench"))
import gpu_queue  # noqa: E402 (beside this script)

CORRECTNESS = gpu_queue.CORRECTNESS
GIB = 2**30


class Results:
    """``DIR/STAGE.json``: ``headline`` (one line for the summary table), ``rows`` (the stage's own table) and any
    other fields; rewritten whole (write, then rename) after every change."""

    def __init__(self, work: str, stage: str):
        self.path, self.data = os.path.join(work, f"{stage}.json"), dict(headline=None, rows=[])

    def update(self, **fields) -> None:
        self.data.update(fields)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def row(self, **row) -> None:
        self.update(rows=self.data["rows"] + [row])


STOPPED = 130  # run()'s status for a command stopped at the stage's cap


def run(cmd: list) -> int:
    """A command in the repository, its output into this stage's (the log); its exit status. At the stage's cap the
    command gets the same SIGINT (one process group): it is let finish (pytest then writes its JUnit), and the stage
    goes on to report what was written, in the grace gpu_check.py gives before SIGKILL (status ``STOPPED``)."""
    print("+ " + " ".join(map(str, cmd)), flush=True)
    proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"(stopped at the stage's cap: {os.path.basename(str(cmd[1]))})", flush=True)
        proc.wait()
        return STOPPED


def load(path: str):
    with open(path) as f:
        return json.load(f)


def env(res: Results, work: str, rehearse: bool, entry=None) -> int:
    """Device, driver, CUDA, library versions, free memory, the wheel install's time. The device and driver are
    recorded from nvidia-smi first: a cold ``import torch`` on a fresh machine took over 10 s on 2026-12-04."""
    from importlib import metadata

    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()
        if smi:
            name, _, driver = smi[0].rpartition(", ")
            res.update(headline=f"{name} (driver {driver}; torch not imported yet)",
                       info=dict(device=name, driver=driver, gpus=len(smi)))
    import torch

    info = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                cpus=os.cpu_count(), install_s=os.environ.get("GPU_CHECK_INSTALL_S") or "no --wheels")
    for dist in ("megatron-core", "deepspeed", "transformers", "datasets", "peft", "traceinsight"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = "not installed"
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        info.update(device=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(),
                    free_gib=round(free / GIB, 1), total_gib=round(total / GIB, 1))
        info["driver"] = res.data.get("info", {}).get("driver", "unknown")
    else:
        info.update(device=f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", gpus=0)
    res.update(headline=f"{info['device']}, torch {info['torch']}, CUDA {info['cuda']}, megatron-core "
                        f"{info['megatron-core']}, DeepSpeed {info['deepspeed']}, transformers {info['transformers']}"
                        + (f", {info['free_gib']} of {info['total_gib']} GiB free" if "free_gib" in info else "")
                        + (", no wheels installed" if not os.environ.get("GPU_CHECK_INSTALL_S") else
                           f", wheel install {info['install_s']}" if info["install_s"].startswith("failed") else
                           f", wheels installed in {info['install_s']} s"),
               rows=[dict(what=k, value=v) for k, v in info.items()], info=info)
    return 0 if (rehearse or info["gpus"]) and not info["install_s"].startswith("failed") else 1


def _gpu_test_files() -> list:
    """The test modules that hold GPU-marked tests (collecting only them keeps the rest stage's start short)."""
    def marked(path: str) -> bool:
        with open(path) as f:
            return "pytest.mark.gpu" in f.read()

    return sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "tests", "*", "test_*.py")) if marked(p))


def _tier(res: Results, work: str, rehearse: bool, xml: str, code: int, want=(), earlier=None,
          earlier_want=CORRECTNESS) -> int:
    """This stage's tests (JUnit ``xml``, pytest's status ``code``; each node id of ``want`` it lacks "not run") as
    rows, and bench/gpu_tier.py's report of the whole tier so far (``earlier``: the correctness stage's file, meant
    to hold ``earlier_want``)."""
    import gpu_tier

    env_json = os.path.join(work, "env.json")
    device = load(env_json).get("info", {}).get("device", "unknown") if os.path.exists(env_json) else "unknown"
    stopped = code == STOPPED
    try:
        mine = gpu_tier.outcomes([xml])
    except gpu_tier.EmptyReport as e:  # stopped before a test finished: still a report when we know what was meant
        if not (stopped and want):
            res.update(headline=f"no test report: {e}")
            return 1
        mine = {}
    except (OSError, gpu_tier.ET.ParseError) as e:
        res.update(headline=f"no test report: {e}")
        return 1
    mine = gpu_tier.expected(mine, list(want), "stopped at the stage's cap" if stopped else "not in pytest's report")
    before = {}
    if earlier:
        try:
            before = gpu_tier.outcomes([earlier])
        except (gpu_tier.EmptyReport, OSError, gpu_tier.ET.ParseError):
            pass
        before = gpu_tier.expected(before, list(earlier_want), "not reported by the correctness stage")
    tier = gpu_tier.summary(gpu_tier.merge(before, mine), device)
    n = collections.Counter(t["outcome"] for t in mine.values())
    outcomes = ("passed", "failed", "error", "not run")
    res.update(headline=", ".join(f"{n[k]} {k}" for k in outcomes) + "; whole tier so far: "
                        + ", ".join(f"{tier['counts'].get(k, 0)} {k}" for k in outcomes)
                        + (" (stopped at the cap: later tests not run)" if stopped else ""),
               counts=tier["counts"], ok=tier["ok"], tier=tier,
               rows=[dict(test=k, outcome=t["outcome"], seconds=round(t["seconds"], 1), reason=t["reason"] or "")
                     for k, t in sorted(mine.items())])
    if n["failed"] or n["error"]:
        return 1
    return 0 if rehearse or n["passed"] else 1  # on a GPU, nothing run proves nothing


def _measured(work: str) -> list:
    """The tests gpu_check.py found measured on this device and versions (DIR/measured.json), not run again."""
    path = os.path.join(work, "measured.json")
    return load(path) if os.path.exists(path) else []


def tests(res: Results, work: str, rehearse: bool, entry) -> int:
    """correctness: the deciding GPU tests not yet measured, as JUnit read by bench/gpu_tier.py (on CPU every one is
    collected and skipped). rest: every other GPU test not yet measured, then the whole tier's report over both
    JUnit files."""
    xml, done = os.path.join(work, f"{entry.id}.xml"), set(_measured(work))
    pytest = [PY, "-m", "pytest", "-q", "-rfEs", "--tb=short", "-p", "no:cacheprovider", "-m", "gpu",
              f"--junitxml={xml}"]
    if entry.id == "correctness":
        want = [t for t in CORRECTNESS if t not in done]
        return _tier(res, work, rehearse, xml, run(pytest + want), want)
    deselect = [a for test in sorted(set(CORRECTNESS) | done) for a in ("--deselect", test)]
    code = run(pytest + _gpu_test_files() + deselect)
    if code == 5:  # every test deselected: all measured
        res.update(headline="every GPU test already measured", counts={}, rows=[])
        return 0
    return _tier(res, work, rehearse, xml, code, earlier=os.path.join(work, "correctness.xml"),
                 earlier_want=[t for t in CORRECTNESS if t not in done])


def _bench_rows(res: Results, path: str, what: str) -> dict:
    """Rows of a bench_qwen/bench_vit JSON: each side (a skipped peer with its reason) and its numerics, the ratio to
    the plain peer on ours, ours against each other peer on that peer's row; the JSON."""
    d = load(path)
    sides = d.get("results") or d.get("rows")
    unit = "tokens_per_sec" if "ratio_tokens_per_sec" in d else "images_per_sec"
    ratio, ratios = d.get(f"ratio_{unit}"), d.get("ratios") or {}
    res.update(device=d.get("device"), versions=d.get("versions"))  # (also when the env stage came back empty)
    for side, r in sides.items():
        if "skipped" in r:
            res.row(what=what, side=side, skipped=r["skipped"])
            continue
        split = r.get("split_ms") or {}  # ours: where the step goes (CUDA events), parts over 1 ms
        mine = ratio if side == "megatron_ext" else None if side in ("transformers", "peft") else ratios.get(side)
        res.row(what=what, side=side, **{unit: round(r[unit], 1)}, mfu="n/a" if r["mfu"] is None else
                f"{r['mfu']:.1%}", step_s=round(r["step_time"], 3), peak_gib=round(r["mem_peak_gib"], 1),
                loss=f"{r['first_loss']:.3f} -> {r['final_loss']:.3f}",
                ratio=f"{mine:.2f}x" if mine else "", numerics=r.get("numerics", ""),
                split_ms=" / ".join(f"{part} {ms:.0f}" for part, ms in split.items() if ms >= 1))
    return d


def _total_gib(work: str) -> float:
    """The device's memory as the env stage found it (0 when unknown)."""
    path = os.path.join(work, "env.json")
    return float(load(path).get("info", {}).get("total_gib") or 0) if os.path.exists(path) else 0.0


def _out(argv: list, work: str) -> str:
    """Where a benchmark command line's JSON goes in this window (by the command's hash)."""
    return os.path.join(work, "bench", hashlib.sha1(" ".join(argv).encode()).hexdigest()[:12] + ".json")


def _bench(argv: list, work: str):
    """Run a benchmark command line once per window: its JSON is kept by the command's hash, so an A/B's default
    that an earlier entry ran is read, not run again. (exit status, the JSON's path)."""
    out = _out(argv, work)
    if os.path.exists(out):
        print(f"(read, not run again: {out} holds {' '.join(argv)})", flush=True)
        return 0, out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    return run([PY, *argv, "--bench-out", out]), out


def _label(argv: list) -> str:
    """A row's name: the model, and what the entry adds to the shared shape."""
    return argv[argv.index("--model") + 1]


def _headline(rows: list) -> str:
    """Every row of ours: speed, MFU, its ratio to the plain peer (or an A/B's to the default) and to each other."""
    parts = []
    for r in (r for r in rows if r["side"] == "megatron_ext"):
        unit = "tokens_per_sec" if "tokens_per_sec" in r else "images_per_sec"
        peers = [p for p in rows if p["what"] == r["what"] and p is not r]
        plain = next((p["side"] for p in peers if p["side"] in ("transformers", "peft")), "transformers")
        ratio = "" if not r["ratio"] else f", {r['ratio']}" + (f" {plain}" if r["ratio"].endswith("x") else "")
        parts.append(f"{r['what']}: {r[unit]:,.0f} {unit.split('_')[0].replace('tokens', 'tok')}/s, MFU {r['mfu']}"
                     + ratio + "".join(f", {p['ratio']} {p['side']}" for p in peers if p.get("ratio")))
    return "; ".join(parts)


def bench(res: Results, work: str, rehearse: bool, entry) -> int:
    """A benchmark row: bench_qwen.py or bench_vit.py as the launchers run it (the Qwen output layer and loss fused
    in chunks: 1.17x transformers against 1.05x unfused, 26 against 38 GiB, the same losses, on the 2026-12-04
    H200), bf16, mock data, ours beside its peers."""
    argv = gpu_queue.command(entry, rehearse, _total_gib(work))
    suffix = entry.id.partition(".")[2].replace(entry.model, "").strip(".")  # speed.qwen2.5-0.5b.lora: lora
    what = _label(argv) + (f" {suffix}" if suffix else "")
    code, out = _bench(argv, work)
    if os.path.exists(out):
        _bench_rows(res, out, what)
        res.update(headline=_headline(res.data["rows"]))
    return int(code != 0)


def _losses(d: dict) -> tuple:
    r = (d.get("results") or d.get("rows"))["megatron_ext"]
    return r["first_loss"], r["final_loss"]


def ab(res: Results, work: str, rehearse: bool, entry) -> int:
    """A lever against our default in the same window: the base entry's command (its row read when an earlier entry
    ran it, else ours alone), then the same with the lever (ours alone); the lever's ratio to the default, and
    whether the losses are equal (within LOSS_RTOL)."""
    default, lever = gpu_queue.commands(entry, rehearse, _total_gib(work))
    if not os.path.exists(_out(default, work)):  # the default's row not run in this window: ours alone, no peers
        default = default + list(gpu_queue.NONE)
    name = " ".join(entry.lever) or f"--micro-batch-size x{entry.scale_mbs}"
    found, failed = [], 0
    for argv, what in ((default, _label(default)), (lever, f"{_label(lever)} {name}")):
        code, out = _bench(argv, work)
        failed |= code != 0
        if os.path.exists(out):
            found.append((_bench_rows(res, out, what), what))
    if len(found) < 2:
        res.update(headline=f"{name}: no A/B (a run failed)")
        return 1
    (base, _), (mine, what) = found
    unit = "tokens_per_sec" if "ratio_tokens_per_sec" in base else "images_per_sec"
    speed = [(d.get("results") or d.get("rows"))["megatron_ext"][unit] for d in (base, mine)]
    ratio = speed[1] / speed[0]
    equal = all(abs(a - b) <= gpu_queue.LOSS_RTOL * abs(a) for a, b in zip(_losses(base), _losses(mine)))
    for r in res.data["rows"]:
        if r["what"] == what and r["side"] == "megatron_ext":
            r["ratio"] = f"{ratio:.2f}x default"
    win = "a win" if equal and ratio >= gpu_queue.WIN else "no win"
    res.update(ratio=ratio, equal_losses=equal, headline=f"{what}: {speed[1]:,.0f} against {speed[0]:,.0f}, "
               f"{ratio:.2f}x the default, losses {'equal' if equal else 'DIFFER'} "
               f"({' -> '.join(f'{x:.3f}' for x in _losses(mine))} vs "
               f"{' -> '.join(f'{x:.3f}' for x in _losses(base))}): {win}")
    return int(failed)


def moe_layer(res: Results, work: str, rehearse: bool, entry=None) -> int:
    """One Qwen1.5-MoE-A2.7B layer (60 experts of 1408, top-4, shared expert) and one Qwen3-30B-A3B layer (128
    experts of 768, top-8): grouped GEMM, SequentialMLP, transformers (eager loop and grouped_mm), forward and
    backward."""
    out = os.path.join(work, "moe_layer.json")
    flags = ["--model", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "--experts", "8", "--tokens", "64", "--reps", "1",
             "--cpu-width-divisor", "16"] if rehearse else \
        ["--model", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "--device", "cuda", "--bf16", "--reps", "5"]
    code = run([PY, "bench/moe_experts.py", *flags, "--out", out])
    if os.path.exists(out):
        for row in load(out)["rows"]:
            for name, r in row["results"].items():
                res.row(model=row["model"], experts=row["experts"], implementation=name, ms=round(1e3 * r["seconds"], 2),
                        tokens_per_sec=round(r["tokens_per_sec"]), mfu="n/a" if r["mfu"] is None else f"{r['mfu']:.1%}",
                        vs_sequential=f"{r['speedup_vs_sequential']:.2f}x", ops=r["ops"], syncs=r["syncs"],
                        max_diff=f"{r['max_abs_diff_vs_sequential']:.1e}")
        by = {(r["model"], r["implementation"]): r for r in res.data["rows"]}
        res.update(headline="; ".join(
            f"{model}: " + ", ".join(f"{k.split(' (')[0] if 'transformers' not in k else k} {r['vs_sequential']}"
                                     for (m, k), r in by.items() if m == model) + " vs SequentialMLP"
            for model in dict.fromkeys(m for m, _ in by)))
    return code


def profile(res: Results, work: str, rehearse: bool, entry=None) -> int:
    """A short profiled Qwen2.5-1.5B run (step 2 traced: 4 micro-batches) and its report (HTA where installed)."""
    logs = os.path.join(work, "profile")
    flags = ["--model", "tiny", "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4"] \
        if rehearse else ["--model", "qwen2.5-1.5b", "--bf16", "--seq-length", "4096", "--micro-batch-size", "2",
                          "--global-batch-size", "8"]
    code = run([PY, "finetune_qwen.py", *flags, "--mock-data", "--train-iters", "3", "--lr", "1e-5", "--profile",
                "--profile-step-start", "2", "--profile-step-end", "3", "--log-dir", logs])
    if code:
        return code
    sys.path.insert(0, REPO)
    from analysis.trace_analysis import analyze
    from analysis.trace_report import write_report
    from analysis.trace_verdict import lines

    result = analyze(os.path.join(logs, "traces"))
    write_report(result, os.path.join(work, "profile_report"))
    verdict = lines(result["verdict"], result["path"] == "hta")
    res.update(headline=verdict[2], verdict=verdict, path=f"{result['path']} ({result['reason']})",
               rows=[dict(part=k, share=f"{v:.1%}") for k, v in result["verdict"]["shares"].items()]
               + [dict(part=f"top: {t['name'][:70]}", share=f"{t['share']:.1%}") for t in result["verdict"]["top"]])
    print("\n".join(verdict))
    return 0


def verify(res: Results, work: str, rehearse: bool, entry=None) -> int:
    """tools/verify_model.py's card for Qwen2.5-1.5B in bf16 on the GPU: random weights in the published shape (no hub
    there), saved as transformers saves them, with the look-alike tokenizer."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from support import hf_fixtures

    directory = os.path.join(work, "qwen2.5-1.5b-random")
    if rehearse:
        hf_fixtures.make_qwen(directory)
    else:
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(Qwen2Config(**hf_fixtures.PUBLISHED["Qwen/Qwen2.5-1.5B"]))
        model.to(torch.bfloat16).save_pretrained(directory)
        del model
        for name in os.listdir(hf_fixtures.TOKENIZER):
            shutil.copy(os.path.join(hf_fixtures.TOKENIZER, name), directory)
    out = os.path.join(work, "verify_card.json")
    code = run([PY, "tools/verify_model.py", "--pretrained", directory, "--tokenizer", directory,
                *(["--bf16"] * (not rehearse)), "--card-json", out])
    if os.path.exists(out):
        card = load(out)
        res.update(headline=("PASS: " if card["passed"] else "FAIL: ") + card["title"], card=card,
                   rows=[dict(check=r["name"], value=r["value"], limit=r["limit"], ok=r["passed"])
                         for r in card["rows"]])
    return code


STAGES = dict(env=env, tests=tests, bench=bench, ab=ab, moe_layer=moe_layer, profile=profile, verify=verify)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("entry", choices=["probe"] + list(gpu_queue.BY_ID))
    p.add_argument("--work", required=True)
    p.add_argument("--rehearse", action="store_true")
    p.add_argument("--hang", action="store_true", help="(gpu_check.py --simulate-hang) hang, deaf to SIGINT")
    args = p.parse_args(argv)
    if args.entry == "probe":
        return gpu_queue.probe(args.work, args.rehearse)
    res = Results(args.work, args.entry)
    res.update(started=time.strftime("%H:%M:%S"))
    if args.hang:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        res.update(headline="simulated hang (--simulate-hang)")
        while True:
            time.sleep(3600)
    entry = gpu_queue.BY_ID[args.entry]
    return STAGES[entry.stage](res, args.work, args.rehearse, entry)


if __name__ == "__main__":
    sys.exit(main())
