"""The math recipe's parts: the before/after report (tools/math_report.py), a published model evaluated by hub id,
and the starting point exported as it was loaded (--train-iters 0)."""

import json
import math
import subprocess
import sys

import pytest
import torch

from support import flag_values
from support import REPO
from support.ranks import run_ranks, run_tool
from support.hf_fixtures import as_hub_cache, make_qwen, tensors
from megatron_ext.errors import ConfigError
from megatron_ext.evaluation import math_eval as ev
from megatron_ext.evaluation import report as rep

TOKENIZER = f"{REPO}/examples/tokenizers/tiny-qwen"


def fake_eval(directory, verdicts, questions=None):
    """An eval_math output whose problem i is scored ``verdicts[i]``, through the real scorer."""
    questions = questions or [f"What is {i} plus {i}?" for i in range(len(verdicts))]
    problems = [{"question": q, "answer": f"#### {2 * i}"} for i, q in enumerate(questions)]
    results = [ev.score(i, p, p["question"], f"The answer is: {2 * i if ok else 2 * i + 1}", 5)
               for i, (p, ok) in enumerate(zip(problems, verdicts))]
    n = len(results)
    summary = dict(accuracy=sum(r["correct"]["metamath"] for r in results) / n, primary_extractor="metamath",
                   no_answer_rate=0.0, samples=n, model=str(directory), data="look-alike")
    ev.write_results(str(directory), results, summary)
    return directory


def test_report_counts_flips_and_pairs_the_interval(tmp_path):
    before = [False] * 20 + [True] * 5 + [False] * 15     # 5 right of 40
    after = [True] * 20 + [False] * 5 + [True] * 10 + [False] * 5  # 20 fixed, 5 broken, 10 more fixed: 30 right
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(dict(step=s, loss=3.0 / s, **({"val_loss": 2.0} if s == 4 else {})))
                               + "\n" for s in range(1, 5)))
    run_tool("math_report", "--before", fake_eval(tmp_path / "b", before), "--after", fake_eval(tmp_path / "a", after),
             "--metrics", metrics, "--out", tmp_path / "report")
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert (report["before"]["correct"], report["after"]["correct"], report["after"]["samples"]) == (5, 30, 40)
    d = report["difference"]
    b, c, n = 30, 5, 40  # computed here from the verdicts: fixed, broken
    assert (d["fixed"], d["broken"]) == (b, c) and d["value"] == pytest.approx(25 / 40)
    z, p = 1.959964, 5 / 40  # Wilson's interval for 5 of 40, in its textbook form
    centre, spread = (p + z * z / (2 * n)) / (1 + z * z / n), z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z
                                                                                              / (4 * n * n))
    assert report["before"]["ci95"] == pytest.approx([centre - spread, centre + spread])
    # Newcombe's method 10 from the counts: both right 0, fixed 30, broken 5, neither 5; phi's numerator 0 - 150 < 0
    (l1, u1), (l2, u2), p1, p2 = report["after"]["ci95"], report["before"]["ci95"], 30 / 40, 5 / 40
    phi = -150 / math.sqrt(30 * 10 * 5 * 35)
    low = p1 - p2 - math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)
    high = p1 - p2 + math.sqrt((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2)
    assert d["ci95"] == pytest.approx([low, high]) and "Newcombe" in d["method"]
    assert [r["index"] for r in report["flipped"]["broken"]] == list(range(20, 25))
    assert len(report["flipped"]["fixed"]) == 30 and report["loss"]["train"][0] == 3.0
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| after: " in md and "+62.5%" in md and "## Right before, wrong after: 5" in md and "and 20 more" in md
    assert (tmp_path / "report" / "report.png").stat().st_size > 10_000


def normal_approximation(before, after):
    """The interval the report used before (McNemar's normal approximation): the planted control."""
    n = len(before)
    fixed, broken = (sum(x and not y for x, y in zip(first, second)) for first, second in ((after, before),
                                                                                          (before, after)))
    d = (fixed - broken) / n
    half = 1.959964 * math.sqrt(max((fixed + broken) / n - d * d, 0.0) / n)
    return [d - half, d + half]


def test_the_paired_interval_stays_95_percent_at_the_boundary():
    """Every problem fixed, 10 of 10: the interval reaches well below +100% (the normal approximation's collapsed to
    +100% to +100%). Over 1,000 simulated evaluations each, the interval holds the true difference about 95% of the
    time near the boundary and away from it; the normal approximation, planted, holds it far less at the boundary."""
    import numpy as np

    from megatron_ext.evaluation.report import paired_difference, wilson

    d = paired_difference([False] * 10, [True] * 10)
    low, high = wilson(10, 10)[0], wilson(0, 10)[1]
    assert d["value"] == 1.0 and d["ci95"] == pytest.approx([1 - math.hypot(1 - low, high), 1.0])
    assert d["ci95"][0] < 0.7 and normal_approximation([False] * 10, [True] * 10) == [1.0, 1.0]
    rng = np.random.default_rng(0)
    for cells, n in (((0.05, 0.9, 0.0, 0.05), 10), ((0.1, 0.6, 0.05, 0.25), 15), ((0.3, 0.2, 0.1, 0.4), 20)):
        truth, held = cells[1] - cells[2], [0, 0]  # cells: both right, fixed, broken, neither
        for _ in range(1000):
            drawn = rng.choice(4, size=n, p=cells)
            before, after = [c in (0, 2) for c in drawn], [c in (0, 1) for c in drawn]
            for k, (lo, hi) in enumerate((paired_difference(before, after)["ci95"],
                                          normal_approximation(before, after))):
                held[k] += lo - 1e-12 <= truth <= hi + 1e-12
        assert held[0] >= 900, (cells, n, held)  # (measured: 92.9%, 95.0%, 94.8% over 2,000)
        if cells[2] == 0.0:
            assert held[1] < 800, (cells, n, held)  # (measured: 63.7%)


def test_the_plot_titles_fit(tmp_path):
    """Every panel's title inside the figure, the flipped problems' two lines included."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from megatron_ext.evaluation import report as rep

    data = dict(before=dict(accuracy=0.0, ci95=[0.0, 0.28], correct=0, samples=10),
                after=dict(accuracy=1.0, ci95=[0.72, 1.0], correct=10, samples=10),
                difference=rep.paired_difference([False] * 10, [True] * 10), loss=None,
                flipped=dict(fixed=[dict(index=i) for i in range(10)], broken=[]))
    fig = rep.plot(data, str(tmp_path / "report.png"))
    renderer = FigureCanvasAgg(fig).get_renderer()
    box = fig.bbox
    for ax in fig.axes:
        extent = ax.title.get_window_extent(renderer)
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and extent.y1 <= box.y1, (ax.get_title(), extent, box)


def test_an_unpaired_report_is_one_line_exit_2(tmp_path):
    fake_eval(tmp_path / "b", [True, False])
    fake_eval(tmp_path / "a", [True, False], questions=["another?", "question?"])
    proc = subprocess.run([sys.executable, "tools/math_report.py", "--before", str(tmp_path / "b"), "--after",
                           str(tmp_path / "a"), "--out", str(tmp_path / "r")], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "evaluated different problems" in proc.stderr and not (tmp_path / "r").exists()
    with pytest.raises(ConfigError, match="--after .*not a tools/eval_math.py output"):
        rep.compare(str(tmp_path / "b"), str(tmp_path / "missing"))


def test_a_published_model_is_evaluated_by_its_hub_id(tmp_path, monkeypatch):
    """eval_math --model org/name reads the Hugging Face cache (offline here) as --pretrained does; the outputs are
    the local directory's; an id the cache lacks is one line naming --model."""
    model = make_qwen(tmp_path / "model")
    as_hub_cache(model, tmp_path / "hub", "org/tiny-qwen")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} plus 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(3)))
    common = ["--data", data, "--max-new-tokens", 8, "--backend", "transformers"]
    run_tool("eval_math", "--model", "org/tiny-qwen", "--output", tmp_path / "hub_eval", *common)
    run_tool("eval_math", "--model", model, "--output", tmp_path / "dir_eval", *common)
    outputs = [[json.loads(line)["output"] for line in open(tmp_path / name / "results.jsonl")]
               for name in ("hub_eval", "dir_eval")]
    assert outputs[0] == outputs[1] and any(outputs[0])
    with pytest.raises(ConfigError, match="^--model org/absent: not in the Hugging Face cache"):
        run_tool("eval_math", "--model", "org/absent", "--output", tmp_path / "absent", *common)


def test_zero_steps_export_the_starting_point_bit_exact(tmp_path):
    """--train-iters 0: the model is built and loaded, no step runs, --save-hf writes what was loaded (the math
    recipe evaluates a run's starting point this way)."""
    source = make_qwen(tmp_path / "source")
    proc = run_ranks(1, ["finetune_qwen.py", "--pretrained", str(source), "--mock-data", "--seq-length", "32",
                         "--train-iters", "0", "--save-hf", str(tmp_path / "hf"), "--log-dir", str(tmp_path / "log")])
    assert "no step to run (--train-iters 0, at step 0)" in proc.stdout and "training summary" not in proc.stdout
    ours, theirs = tensors(tmp_path / "hf"), tensors(source)
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in theirs)


def test_the_cpu_recipe_takes_the_look_alike_from_0_to_90_percent(tmp_path):
    """examples/math_recipe_cpu.sh as written, shortened and on one rank (the test's lane has one core; the same
    flags on two ranks are the parity suite's DP2): the stand-in model answers none of the 10 problems, the LoRA
    fine-tune at least 9, and the report says so; DRY_RUN prints its seven steps."""
    from support.ranks import free_port

    env = dict(__import__("os").environ, RUN_DIR=str(tmp_path / "run"), MASTER_PORT=str(free_port()),
               BASE_ITERS="200", TRAIN_ITERS="150", GPUS_PER_NODE="1")  # shortened (the full recipe: 1m47s on 2 cores, 100%)
    dry = subprocess.run(["bash", "examples/math_recipe_cpu.sh"], cwd=REPO, env=dict(env, DRY_RUN="1"),
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0 and len(dry.stdout.splitlines()) == 7 and "--lora-rank 16" in dry.stdout, dry.stdout
    proc = subprocess.run(["bash", "examples/math_recipe_cpu.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["before"]["accuracy"] <= 0.1 and report["after"]["accuracy"] >= 0.9, report
    assert report["after"]["samples"] == 10 and report["loss"]["train"][-1] < report["loss"]["train"][0]
    assert (tmp_path / "run" / "report.png").is_file() and (tmp_path / "run" / "report.md").is_file()


def test_the_gpu_recipe_wraps_the_lora_launcher_in_evaluations_of_gsm8k(tmp_path):
    """examples/qwen_math_lora_1gpu.sh under DRY_RUN: the published Qwen2.5-1.5B evaluated on GSM8K's test split,
    examples/qwen3b_lora_1gpu.sh's run from it on one GPU (its export in RUN_DIR/hf, its metrics in RUN_DIR/logs,
    extra flags passed on), that export evaluated on the same problems, the report; FULL=1 trains every weight.
    Every step's flags parse as the tools and finetune_qwen.py parse them."""
    import importlib.util
    import shlex

    from megatron_ext.arguments import parse
    from support.launcher_commands import clean_env, parse_command

    def tool(name):
        spec = importlib.util.spec_from_file_location(name, f"{REPO}/tools/{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def steps(**env):
        proc = subprocess.run(["bash", "examples/qwen_math_lora_1gpu.sh", "--train-iters", "7"], cwd=REPO,
                              env=clean_env(DRY_RUN=1, RUN_DIR=tmp_path, **env), capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    before, train, after, report = steps()
    evaluate = tool("eval_math")
    for line, model, out in ((before, "Qwen/Qwen2.5-1.5B", "eval_before"), (after, f"{tmp_path}/hf", "eval_after")):
        argv = shlex.split(line)
        assert argv[:2] == ["python", "tools/eval_math.py"]
        args = evaluate.parse(argv[2:])
        assert (args.model, args.data, args.data_config, args.split, args.output, args.max_samples) == (
            model, "openai/gsm8k", "main", "test", f"{tmp_path}/{out}", None)
    run = parse(parse_command(train).flags, world_size=1)
    assert flag_values(run).pretrained == "Qwen/Qwen2.5-1.5B" and flag_values(run).lora_rank == 16 and flag_values(run).train_iters == 7
    assert (flag_values(run).save_hf, flag_values(run).log_dir, flag_values(run).data_path) == (
        f"{tmp_path}/hf", f"{tmp_path}/logs", "meta-math/MetaMathQA")
    args = tool("math_report").parse(shlex.split(report)[2:])
    assert (args.before, args.after, args.metrics, args.out) == (
        f"{tmp_path}/eval_before", f"{tmp_path}/eval_after", f"{tmp_path}/logs/metrics.jsonl", str(tmp_path))

    before, train, after, _ = steps(FULL=1, EVAL_DATA="problems.jsonl", EVAL_SAMPLES=50)
    assert shlex.split(before)[2:6] == ["--data", "problems.jsonl", "--max-samples", "50"]
    run = parse(parse_command(train).flags, world_size=1)
    assert flag_values(run).lora_rank in (0, None) and flag_values(run).pretrained == "Qwen/Qwen2.5-1.5B" and run.mesh.world == 1
