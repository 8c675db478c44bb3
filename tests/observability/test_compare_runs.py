"""tools/compare_runs.py on synthetic runs whose speedups are known exactly: the numbers in comparison.json, the
files, the markdown table, and every bad input as one line (exit 2) with nothing written."""

import json
import re
import subprocess
import sys

import pytest

from support import REPO
from support.ranks import run_tool
from megatron_ext.errors import ConfigError

PNG = b"\x89PNG\r\n\x1a\n"
SEQ = 256


def records(tokens_per_sec, tokens_per_step=4096, steps=6, mfu=None, mem_gib=1.0):
    """Steady ``tokens_per_sec`` after a warm-up first step at half speed (which the means leave out)."""
    out = []
    for step in range(1, steps + 1):
        speed = tokens_per_sec / 2 if step == 1 else tokens_per_sec
        step_time = tokens_per_step / speed
        r = dict(step=step, loss=5.0 - 0.25 * step, lr=1e-3, grad_norm=1.0, tokens_per_sec=speed,
                 samples_per_sec=tokens_per_step / SEQ / step_time, mfu=mfu, step_time=step_time, data_time=0.0,
                 forward_time=0.5 * step_time, backward_time=0.3 * step_time, pipeline_comm_time=0.0,
                 grad_reduce_time=0.1 * step_time, optimizer_time=0.05 * step_time, other_time=0.05 * step_time,
                 mem_allocated=2 ** 29, mem_reserved=2 ** 29, mem_peak=int(mem_gib * 2 ** 30))
        if step % 3 == 0:
            r["val_loss"] = 5.5 - 0.25 * step
        out.append(r)
    return out


def write_plain(directory, recs):
    """A run dir as an older run left it: metrics.jsonl only, no summary.json."""
    directory.mkdir(parents=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return directory


def write_logged(directory, recs, run_info):
    """A run dir as MetricsLogger writes it, with summary.json's "run"."""
    from megatron_ext.observability.loggers import MetricsLogger

    with MetricsLogger(log_dir=str(directory), run_info=run_info) as logger:
        for r in recs:
            logger.log(r)
    return directory


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """DP on 1 (run info), 2 (only '_2gpu' in its name) and 4 devices (run info, DeepSpeed ZeRO-2, TP2+SP), and a
    2-device run with twice the tokens per step: 1000, 1900, 3600 tokens/s -> speedup 1.9 and 3.6, efficiency 0.95
    and 0.9; the odd one gets none."""
    root = tmp_path_factory.mktemp("runs")
    info = dict(engine="megatron", model="tiny", family="qwen", device="cpu")
    one = write_logged(root / "dp1", records(1000, mfu=0.30, mem_gib=3.0),
                       dict(info, world_size=1, mesh=dict(dp=1, tp=1, pp=1, cp=1, ep=1)))
    two = write_plain(root / "qwen_dp_2gpu", records(1900, mfu=0.285, mem_gib=2.0))
    four = write_logged(root / "tp2", records(3600, mfu=0.27, mem_gib=1.5),
                        dict(info, world_size=4, engine="deepspeed", zero_stage=2,
                             mesh=dict(world=4, tp=2, pp=1, vpp=None, cp=1, ep=1, etp=1, sequence_parallel=True)))
    odd = write_plain(root / "big_2gpu", records(2500, tokens_per_step=8192))
    return root, [one, two, four, odd]


def test_summary_json_keeps_run_info(runs):
    root, _ = runs
    summary = json.loads((root / "dp1" / "summary.json").read_text())
    assert summary["run"]["world_size"] == 1 and summary["run"]["mesh"]["tp"] == 1
    assert summary["tokens_per_sec"] == pytest.approx(1000)  # the rest as before


def test_scaling_report(runs, tmp_path, capsys):
    _, (one, two, four, odd) = runs
    out = tmp_path / "report"
    run_tool("compare_runs", f"{one}:DP1", two, f"{four}:ZeRO-2 TP2", odd, "-o", out)
    result = json.loads((out / "comparison.json").read_text())
    rows = {r["label"]: r for r in result["runs"]}
    assert list(rows) == ["DP1", "qwen_dp_2gpu", "ZeRO-2 TP2", "big_2gpu"]
    assert result["baseline"] == "DP1" and result["speedup_metric"] == "tokens_per_sec"
    base, dp2, dp4, big = rows.values()
    assert [r["world_size"] for r in rows.values()] == [1, 2, 4, 2]
    assert [r["world_size_from"] for r in rows.values()] == ["run_info", "directory name", "run_info",
                                                             "directory name"]
    assert base["baseline"] and base["speedup"] == 1.0 and base["efficiency"] == 1.0
    assert dp2["speedup"] == pytest.approx(1.9) and dp2["efficiency"] == pytest.approx(0.95)
    assert dp4["speedup"] == pytest.approx(3.6) and dp4["efficiency"] == pytest.approx(0.9)
    assert big["speedup"] is None and big["efficiency"] is None
    assert big["not_comparable"] == "8,192 vs 4,096 tokens/step"
    assert [r["tokens_per_step"] for r in rows.values()] == [4096, 4096, 4096, 8192]
    assert [r["samples_per_step"] for r in rows.values()] == [16, 16, 16, 32]
    assert dp2["mean_step_time"] == pytest.approx(4096 / 1900)  # warm-up step left out
    assert dp2["tokens_per_sec"] == pytest.approx(1900) and dp2["samples_per_sec"] == pytest.approx(1900 / SEQ)
    assert [r["mfu"] for r in rows.values()] == pytest.approx([0.30, 0.285, 0.27, None])
    assert [r["mem_peak_gib"] for r in rows.values()] == pytest.approx([3.0, 2.0, 1.5, 1.0])
    assert dp4["time_split"] == pytest.approx(dict(data=0.0, forward=0.5, backward=0.3, pipeline_comm=0.0,
                                                   grad_reduce=0.1, optimizer=0.05, other=0.05))
    assert dp4["time_split_s"]["forward"] == pytest.approx(0.5 * 4096 / 3600)
    assert (base["final_loss"], base["min_loss"], base["final_val_loss"]) == pytest.approx((3.5, 3.5, 4.0))
    assert (base["mesh"], dp2["mesh"], dp4["mesh"]) == ("DP1 TP1 PP1", None, "DP2 TP2+SP PP1")
    assert (base["engine"], dp2["engine"], dp4["engine"]) == ("megatron", None, "deepspeed ZeRO-2")
    assert (base["model"], base["family"], base["device"]) == ("tiny", "qwen", "cpu")
    assert result["plots"] == {name: f"{name}.png" for name in
                               ("throughput", "scaling", "time_split", "memory", "mfu", "loss")}
    assert result["not_drawn"] == {}
    for name in result["plots"].values():
        assert (out / name).read_bytes()[:8] == PNG
    page = (out / "index.html").read_text()
    assert page.count("src='data:image/png;base64,") == 6 and "src='http" not in page
    assert "not comparable: 8,192 vs 4,096 tokens/step" in page

    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("| run | devices | engine | mesh | step time (s) | tokens/s |")
    assert printed[1] == "|" + "---|" * 13
    assert printed[2].startswith("| DP1 | 1 | megatron | DP1 TP1 PP1 | 4.096 | 1,000 |")
    assert "| 1.00x (baseline) | 100.0% |" in printed[2]
    assert printed[3].startswith("| qwen_dp_2gpu | 2 | ? | ? | 2.156 | 1,900 |")
    assert printed[3].endswith("| 1.90x | 95.0% |")
    assert "| deepspeed ZeRO-2 | DP2 TP2+SP PP1 |" in printed[4] and printed[4].endswith("| 3.60x | 90.0% |")
    assert printed[5].endswith("| not comparable: 8,192 vs 4,096 tokens/step | - |")
    assert printed[-1] == f"report: {out / 'index.html'}"


def test_unknown_devices_other_model_and_baseline(tmp_path, capsys):
    """No device counts anywhere: speedups still (the first run is the baseline), no efficiency, no device plots;
    a different model is not comparable; --gpus and --baseline."""
    a = write_plain(tmp_path / "a", records(1000))
    b = write_plain(tmp_path / "b", records(1500))
    vit = write_logged(tmp_path / "c", records(900), dict(family="vit", model="base"))
    q = write_logged(tmp_path / "d", records(800), dict(family="qwen", model="tiny"))
    run_tool("compare_runs", a, b, "-o", tmp_path / "r1")
    result = json.loads((tmp_path / "r1" / "comparison.json").read_text())
    assert [(r["speedup"], r["efficiency"], r["world_size"]) for r in result["runs"]] == [(1.0, None, None),
                                                                                          (1.5, None, None)]
    assert result["plots"]["throughput"] is None and result["plots"]["scaling"] is None
    assert set(result["not_drawn"]) == {"throughput", "scaling", "mfu"}
    assert not (tmp_path / "r1" / "throughput.png").exists() and (tmp_path / "r1" / "loss.png").exists()

    run_tool("compare_runs", a, b, vit, q, "--gpus", "2,-,4,1", "--baseline", "d", "-o", tmp_path / "r2")
    rows = json.loads((tmp_path / "r2" / "comparison.json").read_text())["runs"]
    assert [r["world_size"] for r in rows] == [2, None, 4, 1]
    assert rows[3]["baseline"] and rows[2]["not_comparable"] == "family vit vs qwen"
    assert rows[0]["speedup"] == 1.25 and rows[0]["efficiency"] == 0.625  # model unknown there: assumed the same
    assert rows[1]["speedup"] == 1.875 and rows[1]["efficiency"] is None
    assert "not comparable: family vit vs qwen" in capsys.readouterr().out


def test_runs_of_one_size_draw_no_scaling_and_the_report_goes_beside_them(tmp_path, capsys):
    """docs/observability.md's command (no -o): the report goes beside the first run, not into the current directory; two runs on
    the same device count get no throughput/scaling charts (a dot each, an "ideal" line of one point), and say why."""
    a = write_plain(tmp_path / "runs" / "a", records(1000))
    b = write_plain(tmp_path / "runs" / "b", records(1100))
    run_tool("compare_runs", a, b, "--gpus", "2,2")
    out = tmp_path / "runs" / "comparison"
    result = json.loads((out / "comparison.json").read_text())
    assert result["plots"]["throughput"] is None and result["plots"]["scaling"] is None and (out / "loss.png").exists()
    assert result["not_drawn"]["scaling"].startswith("every run is on 2 device(s): nothing to scale")
    assert capsys.readouterr().out.splitlines()[-1] == f"report: {out / 'index.html'}"


def _bad(tmp_path, name, text):
    d = write_plain(tmp_path / name, [])
    (d / "metrics.jsonl").write_text(text)
    return d


def case_args(case, tmp_path):
    good = write_plain(tmp_path / "good", records(1000))
    line = json.dumps(records(1000)[0]) + "\n"
    if case == "missing":
        return [tmp_path / "nowhere"], "nowhere: no such directory (give a training run's --log-dir)"
    if case == "no_metrics":
        (tmp_path / "plain").mkdir()
        return [tmp_path / "plain"], "plain has no metrics.jsonl: give a training run's --log-dir"
    if case == "empty":
        return [good, _bad(tmp_path, "e", "")], "e/metrics.jsonl line 1: the file is empty"
    if case == "corrupt":
        return [_bad(tmp_path, "c", line * 2 + line[:40] + "\n")], "c/metrics.jsonl line 3: not valid JSON"
    if case == "not_a_number":
        return [_bad(tmp_path, "n", line + line.replace('"step_time": ', '"step_time": "x", "_": '))], \
            "n/metrics.jsonl line 2: 'step_time' is 'x', not a number"
    if case == "eval_only":
        return [_bad(tmp_path, "v", '{"step": 5, "val_loss": 2.0}\n')], "no training step"
    if case == "no_runs":
        return [], "no run directories given"
    if case == "output_is_run":
        return [good, "-o", good], "is the run directory"
    if case == "bad_summary":
        (good / "summary.json").write_text("{")
        return [good], "good/summary.json: not valid JSON"
    if case == "same_label":
        return [f"{good}:x", f"{write_plain(tmp_path / 'g2', records(9))}:x"], "label 'x' names two runs"
    if case == "gpus_count":
        return [good, "--gpus", "1,2"], "--gpus gives 2 device counts for 1 run(s)"
    if case == "gpus_value":
        return [good, "--gpus", "two"], "'two' is not a device count"
    return [good, "--baseline", "nope"], "--baseline 'nope' is none of the runs' labels: good"


CASES = ["missing", "no_metrics", "empty", "corrupt", "not_a_number", "eval_only", "no_runs", "output_is_run",
         "bad_summary", "same_label", "gpus_count", "gpus_value", "baseline"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_messages(case, tmp_path):
    args, expect = case_args(case, tmp_path)
    out = [] if "-o" in args else ["-o", tmp_path / "out"]
    with pytest.raises(ConfigError, match=re.escape(expect)) as err:
        run_tool("compare_runs", *args, *out)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
    if case == "output_is_run":
        assert not (tmp_path / "good" / "comparison.json").exists()


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    args, expect = case_args("corrupt", tmp_path)
    proc = subprocess.run([sys.executable, "tools/compare_runs.py", *map(str, args), "-o", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and expect in proc.stderr
    assert not (tmp_path / "out").exists()
