"""Did a fine-tune help? Two ``tools/eval_math.py`` outputs of the same problems (before and after) and the run's
metrics as one report: ``report.json``, ``report.md`` and ``report.png``.

The difference of the two accuracies is paired (the same problems, scored twice): with ``b`` fixed (wrong -> right)
and ``c`` broken (right -> wrong) of ``n``, ``d = (b - c) / n``, and its 95% interval is Newcombe's score interval
for paired proportions (1998, his method 10: the two accuracies' Wilson intervals combined through the pairs'
correlation), which stays a 95% interval where the normal approximation collapses (every problem fixed: it gave
+100% to +100%). Each accuracy's own interval is Wilson's.
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional, Tuple

from megatron_ext.errors import ConfigError

Z95 = 1.959964
SHOWN = 10  # flipped problems listed in report.md and the plot


def read_eval(directory: str, flag: str) -> Tuple[dict, List[dict]]:
    """summary.json and results.jsonl of an eval_math output directory; one line naming ``flag`` otherwise."""
    try:
        with open(os.path.join(directory, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(directory, "results.jsonl")) as f:
            results = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {directory}: not a tools/eval_math.py output ({e.__class__.__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not results:
        raise ConfigError(f"{flag} {directory}: results.jsonl has no problems")
    return summary, results


def wilson(correct: int, n: int) -> Tuple[float, float]:
    centre, half = correct + Z95 ** 2 / 2, Z95 * math.sqrt(correct * (n - correct) / n + Z95 ** 2 / 4)
    return (centre - half) / (n + Z95 ** 2), (centre + half) / (n + Z95 ** 2)


def paired_difference(before: List[bool], after: List[bool]) -> dict:
    """``after`` - ``before`` accuracy and Newcombe's 95% interval for it (method 10, as Altman et al.'s "Statistics
    with confidence" works it: the pairs' phi coefficient with its continuity correction, 0 when a margin is empty)."""
    n = len(before)
    both = sum(b and a for b, a in zip(before, after))
    fixed = sum(a and not b for b, a in zip(before, after))
    broken = sum(b and not a for b, a in zip(before, after))
    neither = n - both - fixed - broken
    p1, p2 = (both + fixed) / n, (both + broken) / n  # after, before
    (l1, u1), (l2, u2) = wilson(both + fixed, n), wilson(both + broken, n)
    margins = (both + fixed) * (broken + neither) * (both + broken) * (fixed + neither)
    cross = both * neither - fixed * broken
    cross = cross - n / 2 if cross > n / 2 else cross if cross < 0 else 0.0
    phi = cross / math.sqrt(margins) if margins else 0.0
    d = p1 - p2
    low = d - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    high = d + math.sqrt(max((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2, 0.0))
    return dict(value=d, ci95=[low, high], fixed=fixed, broken=broken,
                method="Newcombe's score interval for paired proportions (1998, method 10)")


def compare(before_dir: str, after_dir: str, metrics: Optional[str] = None) -> dict:
    """The report's content; refuses two evaluations of different problems (one line)."""
    sides = {}
    for name, directory in (("before", before_dir), ("after", after_dir)):
        summary, results = read_eval(directory, f"--{name}")
        extractor = summary.get("primary_extractor", "metamath")
        sides[name] = (summary, results, [bool(r["correct"][extractor]) for r in results])
    questions = [[r["question"] for r in sides[name][1]] for name in ("before", "after")]
    if questions[0] != questions[1]:
        raise ConfigError(f"--before {before_dir} and --after {after_dir} evaluated different problems "
                          f"({len(questions[0])} and {len(questions[1])}); evaluate both on the same --data and "
                          f"--max-samples")
    report: Dict[str, object] = {}
    for name, (summary, results, correct) in sides.items():
        n, k = len(correct), sum(correct)
        report[name] = dict(model=summary.get("model"), accuracy=k / n, correct=k, samples=n,
                            ci95=list(wilson(k, n)), no_answer_rate=summary.get("no_answer_rate"))
    before, after = sides["before"][2], sides["after"][2]
    report["difference"] = paired_difference(before, after)
    report["flipped"] = {key: [dict(index=r["index"], question=r["question"], gold=r["gold"])
                               for r, b, a in zip(sides["after"][1], before, after) if (a, b) == now_then]
                         for key, now_then in (("fixed", (True, False)), ("broken", (False, True)))}
    report["data"] = sides["after"][0].get("data")
    report["loss"] = _losses(metrics) if metrics else None
    return report


def _losses(path: str) -> dict:
    """Training and validation loss per step from a run's metrics.jsonl."""
    try:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise ConfigError(f"--metrics {path}: cannot read it ({e.__class__.__name__})") from None
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    return dict(steps=[s for s, _ in train], train=[v for _, v in train], val_steps=[s for s, _ in val],
                val=[v for _, v in val])


def markdown(report: dict) -> str:
    b, a, d = report["before"], report["after"], report["difference"]
    lines = ["# Math accuracy before and after fine-tuning", "",
             f"Data: {report.get('data')}, {a['samples']} problems.", "",
             "| model | accuracy | correct | 95% interval | no answer |", "| --- | --- | --- | --- | --- |"]
    for name, side in (("before", b), ("after", a)):
        lines.append(f"| {name}: {side['model']} | {side['accuracy']:.1%} | {side['correct']}/{side['samples']} | "
                     f"{side['ci95'][0]:.1%} to {side['ci95'][1]:.1%} | {side['no_answer_rate']:.1%} |")
    lines += ["", f"Difference: {d['value']:+.1%} (95% interval {d['ci95'][0]:+.1%} to {d['ci95'][1]:+.1%}; "
              f"{d['fixed']} fixed, {d['broken']} broken; {d['method']}).", ""]
    for key, title in (("fixed", "Wrong before, right after"), ("broken", "Right before, wrong after")):
        rows = report["flipped"][key]
        lines.append(f"## {title}: {len(rows)}")
        lines += [f"- #{r['index']} (gold {r['gold']}): {r['question'][:120]}" for r in rows[:SHOWN]]
        lines += [f"- ... and {len(rows) - SHOWN} more (report.json)"] if len(rows) > SHOWN else []
        lines.append("")
    loss = report.get("loss")
    if loss and loss["train"]:
        lines.append(f"Training loss {loss['train'][0]:.4f} at step {loss['steps'][0]} -> {loss['train'][-1]:.4f} "
                     f"at step {loss['steps'][-1]}.")
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict, path: str):
    """report.png: the accuracies with their intervals, the loss, the flipped problems; the figure."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4), layout="constrained")
    acc, loss_ax, flips = fig.subplots(1, 3)
    sides = [report["before"], report["after"]]
    values = [s["accuracy"] for s in sides]
    errors = [[v - s["ci95"][0] for v, s in zip(values, sides)], [s["ci95"][1] - v for v, s in zip(values, sides)]]
    acc.bar(["before", "after"], values, yerr=errors, capsize=6, color=["#999999", "#2a7ab9"])
    for x, (v, s) in enumerate(zip(values, sides)):
        acc.text(x, v + 0.02, f"{v:.0%} ({s['correct']}/{s['samples']})", ha="center")
    acc.set_ylim(0, 1.12)
    acc.set_title("accuracy (95% interval)")
    loss = report.get("loss")
    if loss and loss["train"]:
        loss_ax.plot(loss["steps"], loss["train"], label="train")
        if loss["val"]:
            loss_ax.plot(loss["val_steps"], loss["val"], "o-", label="validation")
        loss_ax.legend()
    loss_ax.set_title("loss")
    loss_ax.set_xlabel("step")
    d = report["difference"]
    counts = [len(report["flipped"]["fixed"]), len(report["flipped"]["broken"])]
    flips.barh(["wrong -> right", "right -> wrong"], counts, color=["#3a9a4a", "#c0392b"])
    for y, key in enumerate(("fixed", "broken")):
        shown = ", ".join(f"#{r['index']}" for r in report["flipped"][key][:6])
        flips.text(0, y, f" {counts[y]}  {shown}", va="center")
    flips.set_xlim(0, max(counts + [1]) * 1.6)
    flips.set_title(f"flipped problems\ndifference {d['value']:+.0%} (95%: {d['ci95'][0]:+.0%} to "
                    f"{d['ci95'][1]:+.0%})")
    fig.savefig(path, dpi=100)
    return fig


def write(report: dict, out: str) -> List[str]:
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, name) for name in ("report.json", "report.md", "report.png")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(report))
    plot(report, paths[2])
    return paths
