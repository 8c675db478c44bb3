"""How long training waits for a checkpoint: foreground saves against --async-save, and the steps/s of a run saving
every 2 steps against one that never saves; 2 CPU ranks (TP2), AdamW state, the quickstart's tiny Qwen2 and a
Qwen2.5-0.5B-shaped one (random init, mock data).

    python bench/async_save.py --workdir /tmp/async_save --out bench/results/async_save_cpu.json

Each (model, mode) is one torchrun launch of finetune_qwen.py; its metrics.jsonl gives each save's staging time (all
an async save blocks for), what the step loop waited in all (a foreground save; under --async-save the staging, the
commits, and a save in flight that the next one waits for) and each save's total time (staging to commit).
The run's last save is written in the foreground in both modes (the run ends after it), so
only the saves before it count. Steps/s = steps / (their step times + the time the loop waited for saves).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"tiny": ["--model", "tiny", "--seq-length", "256", "--global-batch-size", "8", "--micro-batch-size", "4"],
          "qwen2.5-0.5b": ["--model", "qwen2.5-0.5b", "--seq-length", "32", "--global-batch-size", "2",
                           "--micro-batch-size", "1"]}
MODES = {"no saves": [], "sync": ["--save-interval", "2"], "async": ["--save-interval", "2", "--async-save"]}


def launch(workdir: str, model: str, mode: str, steps: int) -> dict:
    run = os.path.join(workdir, f"{model}_{mode.replace(' ', '_')}")
    shutil.rmtree(run, ignore_errors=True)
    flags = MODELS[model] + ["--mock-data", "--tensor-model-parallel-size", "2", "--train-iters", str(steps),
                             "--log-dir", os.path.join(run, "log")] + MODES[mode]
    if mode != "no saves":
        flags += ["--save", os.path.join(run, "ckpt")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29613",
                    "finetune_qwen.py", *flags], cwd=REPO, env=env, check=True, capture_output=True, text=True)
    with open(os.path.join(run, "log", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    size = sum(os.path.getsize(os.path.join(d, name)) for d, _, names in os.walk(os.path.join(run, "ckpt"))
               for name in names) if mode != "no saves" else 0
    shutil.rmtree(run, ignore_errors=True)
    saves = [r for r in records if "save_staging_time" in r and r["step"] < steps]
    totals = [r["save_total_time"] for r in records if r.get("saved_step", steps) < steps]
    waited = [r.get("save_blocking_time", 0.0) for r in records if r["step"] < steps]
    return dict(saves=len(saves), checkpoint_bytes=size // max(1, len(saves) + 1),
                staging_per_save=sum(r["save_staging_time"] for r in saves) / len(saves) if saves else None,
                waited_per_save=sum(waited) / len(saves) if saves else None,
                total_per_save=sum(totals) / len(totals) if totals else None,
                steps_per_sec=len(records) / (sum(r["step_time"] for r in records)
                                              + sum(r.get("save_blocking_time", 0.0) for r in records)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/async_save")
    p.add_argument("--out", default=None)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=9, help="saves at 2, 4, 6, 8 count; the last save is the final one")
    args = p.parse_args(argv)
    results = {}
    for model in args.models.split(","):
        results[model] = {mode: launch(args.workdir, model, mode, args.steps) for mode in MODES}
        sync, background = results[model]["sync"], results[model]["async"]
        # the goal: the loop blocks for the staging of an async save, against the whole of a foreground one
        results[model]["async_blocking_share_of_sync"] = background["staging_per_save"] / sync["waited_per_save"]
    print(f"{'model':<14} {'mode':<9} {'checkpoint':>10} {'staging':>8} {'waited/save':>12} {'total/save':>11} "
          f"{'steps/s':>8}")
    for model, modes in results.items():
        for mode in MODES:
            r = modes[mode]
            cells = [f"{r['checkpoint_bytes'] / 2**30:.2f} GiB" if r["saves"] else "-"] + [
                f"{r[key]:.2f} s" if r[key] is not None else "-"
                for key in ("staging_per_save", "waited_per_save", "total_per_save")] + [f"{r['steps_per_sec']:.2f}"]
            print(f"{model:<14} {mode:<9} {cells[0]:>10} {cells[1]:>8} {cells[2]:>12} {cells[3]:>11} {cells[4]:>8}")
        print(f"{model:<14} an async save blocks for {modes['async_blocking_share_of_sync']:.0%} of a sync one")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device="cpu (2 cores), 2 ranks, gloo", steps=args.steps, results=results), f, indent=2)


if __name__ == "__main__":
    main()
