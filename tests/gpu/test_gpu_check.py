"""bench/gpu_check.py, rehearsed on CPU as before every GPU window: every stage through the plumbing a GPU run uses
(caps, JUnit, bench/gpu_tier.py, JSON, tables), a hung stage killed at its cap while the later stages still run,
and a budget that ends the command whatever happens."""

import json
import os
import subprocess
import sys
import time

from support import flag_values
from support import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import gpu_check  # noqa: E402
import gpu_stages  # noqa: E402

NAMES = [name for name, _, _ in gpu_check.STAGES]


def check(out, *flags, budget):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--rehearse", "--out", str(out), "--budget",
                           str(budget), *flags], cwd=REPO, capture_output=True, text=True, timeout=budget + 60)
    return proc, time.monotonic() - start, json.loads((out / "gpu_check.json").read_text())


def stage_processes() -> list:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "gpu_stages.py" in line]


def test_rehearsal_survives_a_hung_stage(tmp_path):
    """The whole rehearsal in 150 s (one core of a busy machine) with speed_qwen hung (deaf to SIGINT): it is killed
    at its 5 s cap, recorded timed_out, and every other stage passes, rest after it included; the report has one row
    per stage and each stage's own table; the correctness stage's tier lists every deciding test, not run here (no
    CUDA). (speed_qwen's own rehearsal rows: bench_qwen's tests in tests/observability/test_bench.py; its GPU command lines:
    test_the_real_commands_are_valid_runs.)"""
    proc, wall, report = check(tmp_path, "--simulate-hang", "speed_qwen", "--cap", "speed_qwen=5", budget=150)
    stages = {s["name"]: s for s in report["stages"]}
    assert [s["name"] for s in report["stages"]] == NAMES and wall < 150, (wall, proc.stdout)
    assert stages["speed_qwen"]["status"] == "timed_out" and 4 <= stages["speed_qwen"]["seconds"] < 7, stages
    assert stages["speed_qwen"]["results"]["headline"] == "simulated hang (--simulate-hang)"
    failed = {n: (s["status"], (s["results"] or {}).get("headline")) for n, s in stages.items()
              if n != "speed_qwen" and s["status"] != "passed"}
    assert not failed, (failed, proc.stdout[-3000:], (tmp_path / "gpu_check.log").read_text()[-6000:])
    assert proc.returncode == 1 and not stage_processes()
    assert report["device"].startswith("CPU") and report["rehearse"] and report["budget_s"] == 150
    tests = {row["test"]: row for row in stages["correctness"]["results"]["rows"]}
    ids = {t.replace("/", ".").replace(".py::", "::") for t in gpu_stages.CORRECTNESS}
    assert {t.split("[")[0] for t in tests} == {i.split("[")[0] for i in ids} and len(tests) == 11, tests
    assert all(r["outcome"] == "not run" and r["reason"] == "needs a CUDA GPU" for r in tests.values())
    rest = stages["rest"]["results"]
    assert rest["counts"]["not run"] == len(tests) + len(rest["rows"]) and not set(tests) & {r["test"] for r in
                                                                                           rest["rows"]}
    assert stages["speed_qwen"]["results"]["rows"] == []  # killed before its first bench ended
    moe = stages["moe_layer"]["results"]["rows"]
    assert {r["model"] for r in moe} == {"qwen1.5-moe-a2.7b", "qwen3-30b-a3b"}
    assert {r["implementation"] for r in moe} == {"SequentialMLP (megatron-core)", "grouped (torch._grouped_mm)",
                                                  "transformers (eager)", "transformers (grouped_mm)"}
    assert [r["side"] for r in stages["vit"]["results"]["rows"]] == ["megatron_ext"]  # (no baseline: rehearsal)
    profile = stages["profile"]["results"]
    assert profile["headline"].startswith("Try first:") and {"compute", "idle"} <= {r["part"] for r in
                                                                                      profile["rows"]}, profile
    card = {r["check"]: r for r in stages["verify"]["results"]["rows"]}
    assert card["--save-hf round trip"]["value"] == "bit-exact" and all(r["ok"] for r in card.values()), card
    md = (tmp_path / "gpu_check.md").read_text().splitlines()
    assert md[0] == "# GPU check: " + report["device"]
    assert [line.split(" | ")[0][2:] for line in md[6:14]] == NAMES and "| speed_qwen | timed_out |" in md[8]
    assert {f"## {n} (passed" for n in ("env", "correctness", "moe_layer", "vit", "profile", "verify", "rest")} <= {
        line.split(",")[0] for line in md}


def test_the_budget_ends_the_command_whatever_hangs(tmp_path):
    """A 6 s budget and a stage that hangs with a 40 s cap: killed when the budget is spent, the later stages
    skipped with the reason, the report written."""
    proc, wall, report = check(tmp_path, "--simulate-hang", "env", budget=6)
    assert wall < 7 and proc.returncode == 1 and 3 <= report["stages"][0]["seconds"] < 5, report
    assert [(s["name"], s["status"]) for s in report["stages"]] == [("env", "timed_out")] + [
        (n, "skipped") for n in NAMES[1:]]
    assert report["stages"][1]["note"].startswith("budget spent") and not stage_processes()


def test_the_real_commands_are_valid_runs(monkeypatch, tmp_path):
    """The GPU stages' own command lines (not the rehearsal's) pass their scripts' validation here: a window must
    not be lost to a flag that a later change renamed. On a device of over 100 GiB (the env stage's record) the speed
    stage doubles its micro-batches."""
    import bench_qwen
    import bench_vit

    from megatron_ext import arguments

    commands = []
    monkeypatch.setattr(gpu_stages, "run", lambda cmd: commands.append([str(c) for c in cmd]) or 1)
    for stage in ("speed_qwen", "moe_layer", "vit", "profile"):
        gpu_stages.STAGES[stage](gpu_stages.Results(str(tmp_path), stage), str(tmp_path), False)
    assert [c[1] for c in commands] == ["bench/bench_qwen.py"] * 4 + ["bench/moe_experts.py", "bench/bench_vit.py",
                                                                       "finetune_qwen.py"]
    assert commands[3][commands[3].index("--sdpa-backend") + 1] == "cudnn"
    assert commands[4][2:] == ["--model", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "--device", "cuda", "--bf16",
                               "--reps", "5", "--out", str(tmp_path / "moe_layer.json")]
    models = []
    for argv in commands[:4] + commands[5:]:
        family = "vit" if "vit" in argv[1] else "qwen"
        forward = {"bench/bench_qwen.py": bench_qwen, "bench/bench_vit.py": bench_vit}[argv[1]].split_argv(
            argv[2:])[1] if argv[1].startswith("bench/") else argv[2:]
        run = arguments.parse(forward, world_size=1, family=family)
        models.append((flag_values(run).model, flag_values(run).bf16, getattr(flag_values(run), "seq_length", None),
                       run.lora.rank if run.lora else None, flag_values(run).cross_entropy_loss_fusion,
                       flag_values(run).micro_batch_size))
    assert models == [("qwen2.5-1.5b", True, 4096, None, True, 2), ("qwen2.5-0.5b", True, 4096, None, True, 4),
                      ("qwen2.5-0.5b", True, 4096, 16, True, 4), ("qwen2.5-0.5b", True, 4096, None, True, 4),
                      ("vit-huge-14", True, 257, None, False, 64), ("qwen2.5-1.5b", True, 4096, None, False, 2)]

    (tmp_path / "env.json").write_text(json.dumps({"info": {"total_gib": 139.8}}))  # an H200
    commands.clear()
    gpu_stages.speed_qwen(gpu_stages.Results(str(tmp_path), "speed_qwen"), str(tmp_path), False)
    assert [argv[argv.index("--micro-batch-size") + 1] for argv in commands] == ["4", "8", "8", "8"]


def test_gpu_runs_start_together_and_a_failure_still_fails(monkeypatch):
    """conftest.run_concurrently on a CUDA machine (real processes): every launch starts before any ends, each
    sees one inductor compile thread, the environment is restored, and a failing launch fails the caller."""
    import threading

    from support import forked_ranks
    import pytest

    from support.ranks import run_concurrently

    monkeypatch.setattr(forked_ranks, "real_processes", lambda: True)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    barrier = threading.Barrier(3, timeout=10)  # would time out if the launches ran one after another

    def launch(name):
        barrier.wait()
        return name, os.environ["TORCHINDUCTOR_COMPILE_THREADS"]

    assert run_concurrently({n: (lambda n=n: launch(n)) for n in "abc"}) == {n: (n, "1") for n in "abc"}
    assert "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ
    with pytest.raises(pytest.fail.Exception, match="rank failed"):
        run_concurrently({"ok": lambda: 0, "bad": lambda: pytest.fail("rank failed")})


def test_the_speed_rows_say_ours_beside_transformers(tmp_path, monkeypatch):
    """The speed stage's rows: each model's two sides with the ratio on ours and where our step goes, then the LoRA
    row (no baseline: transformers would train every weight) and the cuDNN-attention experiment (its ratio taken
    against the transformers row of the same model and batch) last, so a stage stopped at its cap loses them first;
    the headline names every row of ours; the device and versions are kept (the env stage's were lost once)."""
    speeds = {"qwen2.5-1.5b": (40000.0, 37000.0), "qwen2.5-0.5b": (77000.0, 81000.0)}

    def bench(cmd):
        argv = [str(c) for c in cmd]
        model, out = argv[argv.index("--model") + 1], argv[argv.index("--bench-out") + 1]
        ours, theirs = speeds[model]
        if "cudnn" in argv:
            ours = 90000.0
        side = dict(mfu=0.3, step_time=1.0, mem_peak_gib=30.0, first_loss=12.0, final_loss=11.0)
        results = {"megatron_ext": dict(side, tokens_per_sec=ours, split_ms=dict(forward=300.4, backward=600.0,
                                                                                 optimizer=20.0, data=0.2))}
        if "hf" in argv:
            results["transformers"] = dict(side, tokens_per_sec=theirs)
        with open(out, "w") as f:
            json.dump(dict(results=results, ratio_tokens_per_sec=ours / theirs if "hf" in argv else None,
                           device="NVIDIA H200", versions=dict(torch="2.11.0+cu130")), f)
        return 0

    monkeypatch.setattr(gpu_stages, "run", bench)
    res = gpu_stages.Results(str(tmp_path), "speed_qwen")
    assert gpu_stages.speed_qwen(res, str(tmp_path), False) == 0
    rows = [(r["what"], r["side"], r["ratio"]) for r in res.data["rows"]]
    assert rows == [("qwen2.5-1.5b", "megatron_ext", "1.08x"), ("qwen2.5-1.5b", "transformers", ""),
                    ("qwen2.5-0.5b", "megatron_ext", "0.95x"), ("qwen2.5-0.5b", "transformers", ""),
                    ("qwen2.5-0.5b LoRA r=16", "megatron_ext", ""),
                    ("qwen2.5-0.5b --sdpa-backend cudnn", "megatron_ext", "1.11x")], rows  # (vs transformers' row)
    splits = {r["side"]: r["split_ms"] for r in res.data["rows"] if r["what"] == "qwen2.5-0.5b"}
    assert splits == {"megatron_ext": "forward 300 / backward 600 / optimizer 20", "transformers": ""}
    saved = json.loads((tmp_path / "speed_qwen.json").read_text())
    assert (saved["device"], saved["versions"]) == ("NVIDIA H200", {"torch": "2.11.0+cu130"})  # (env's may be lost)
    assert saved["rows"] == res.data["rows"] and saved["headline"] == (
        "qwen2.5-1.5b: 40,000 tok/s, MFU 30.0%, 1.08x transformers; qwen2.5-0.5b: 77,000 tok/s, MFU 30.0%, 0.95x "
        "transformers; qwen2.5-0.5b LoRA r=16: 77,000 tok/s, MFU 30.0%; qwen2.5-0.5b --sdpa-backend cudnn: "
        "90,000 tok/s, MFU 30.0%, 1.11x transformers")


def test_a_correctness_stage_stopped_at_its_cap_lists_what_it_did_not_reach(tmp_path):
    """The second H200 window's correctness stage ran 9 deciding tests and was stopped at its cap: its report said
    "0 not run". The stage's tests that pytest never reported now read "not run" (stopped at the stage's cap), also
    when none finished (pytest's nameless placeholder), and fail the stage on a GPU; rest's tier counts them too."""
    first = "tests/gpu/test_gpu_megatron.py::test_megatron_engine_trains_a_real_preset_in_bf16"
    xml = tmp_path / "correctness.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.gpu.test_gpu_megatron" name="'
                   + first.split("::")[1] + '" time="30"/><testcase time="0.000" /></testsuite></testsuites>')
    res = gpu_stages.Results(str(tmp_path), "correctness")
    assert gpu_stages._tier(res, str(tmp_path), False, str(xml), gpu_stages.STOPPED, gpu_stages.CORRECTNESS) == 0
    rows = {r["test"]: (r["outcome"], r["reason"]) for r in res.data["rows"]}
    assert rows.pop("tests.gpu.test_gpu_megatron::" + first.split("::")[1]) == ("passed", "")
    assert len(rows) == len(gpu_stages.CORRECTNESS) - 1 and set(rows.values()) == {
        ("not run", "stopped at the stage's cap")}, rows
    assert res.data["headline"].startswith("1 passed, 0 failed, 0 error, 9 not run") and "stopped at the cap" in \
        res.data["headline"]
    xml.write_text('<testsuites><testsuite><testcase time="0.000" /></testsuite></testsuites>')
    assert gpu_stages._tier(res, str(tmp_path), False, str(xml), gpu_stages.STOPPED, gpu_stages.CORRECTNESS) == 1
    assert res.data["headline"].startswith("0 passed, 0 failed, 0 error, 10 not run")
    rest = tmp_path / "rest.xml"
    rest.write_text('<testsuites><testsuite><testcase classname="tests.test_kernels" name="k" time="1"/>'
                    '</testsuite></testsuites>')
    res = gpu_stages.Results(str(tmp_path), "rest")
    assert gpu_stages._tier(res, str(tmp_path), False, str(rest), 0, earlier=str(xml)) == 0
    assert [r["test"] for r in res.data["rows"]] == ["tests.test_kernels::k"] and res.data["tier"]["counts"] == {
        "passed": 1, "not run": 10}
