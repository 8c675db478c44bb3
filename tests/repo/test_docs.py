"""README.md and docs/: README an entry point (at most 1,300 words) with the two commands first, pointing at the
evidence page and the GPU check; links that resolve; and every command in a ``bash`` block that still runs or
parses: launchers print their command (``DRY_RUN=1``), the entry scripts' flags pass every check ``arguments.parse``
makes before process groups (world size from torchrun's flags; hub ids resolve offline to their published
config.json: ``hf_fixtures.py``), and the tools' and benchmarks' flags parse with their own argparse (stopped right
after parsing)."""

import argparse
import glob
import importlib.util
import os
import re
import shlex
import subprocess

import pytest

from support import REPO

PAGES = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
ENTRY = {"finetune_qwen.py": "qwen", "pretrain_vit.py": "vit", "pretrain_gpt.py": "gpt"}
PYTHONS = {"python", "python3", ".venv/bin/python"}


def commands(page: str):
    """(page, command) for each shell command in the page's ``bash`` blocks: continuations joined, comments cut,
    ``a && b`` and ``a; b`` split."""
    text = open(os.path.join(REPO, page)).read()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#\s|^#", line)[0].strip()
            for part in re.split(r"\s&&\s|;\s", line):
                if part.strip():
                    yield page, part.strip()


ALL = [c for page in PAGES for c in commands(page)]


def test_readme_is_short_and_starts_with_the_two_commands():
    """The evidence (what runs where, with proof) lives in docs/what-works-where.md only: README points at it."""
    text = open(os.path.join(REPO, "README.md")).read()
    lines = text.splitlines()
    assert len(text.split()) <= 1300 and len(lines) <= 200, (len(text.split()), len(lines))
    assert "docs/what-works-where.md" in text and "bench/gpu_check.py" in text and "bench/README.md" in text
    first_block = lines.index("```bash")
    assert lines[first_block + 1].startswith("bash examples/cpu_quickstart.sh")
    assert lines[first_block + 2].startswith("bash scripts/setup_venv.sh && .venv/bin/python -m pytest -n 2 tests")


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    text = open(os.path.join(REPO, page)).read()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert os.path.exists(os.path.join(REPO, os.path.dirname(page), target)), f"{page}: {target}"


class _Parsed(Exception):
    pass


def parse_tool(script: str, argv) -> None:
    """The tool's own argparse on ``argv``; stops right after parsing (nothing runs)."""
    spec = importlib.util.spec_from_file_location(f"doc_{os.path.basename(script)[:-3]}", os.path.join(REPO, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        with pytest.raises(_Parsed):
            try:
                module.main(list(argv))
            except TypeError:  # main() without an argv parameter reads sys.argv
                import sys
                saved, sys.argv = sys.argv, [script, *argv]
                try:
                    module.main()
                finally:
                    sys.argv = saved
    finally:
        argparse.ArgumentParser.parse_args = original


def world_of(words) -> int:
    flags = dict(zip(words, words[1:]))
    return int(flags.get("--nproc-per-node", flags.get("--nproc_per_node", 1))) * int(flags.get("--nnodes", 1))


def check(command: str, tmp_path) -> str:
    words = shlex.split(command)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0] == "bash" and words[1].startswith("examples/"):
        proc = subprocess.run(["bash", *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, **env, DRY_RUN="1"))
        assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-2000:]
        return "launcher"
    if words[0] in ("bash", "sbatch"):
        assert os.path.exists(os.path.join(REPO, next(w for w in words[1:] if not w.startswith("-")))), command
        return "script"
    if words[0] in PYTHONS and words[1:3] == ["-m", "pytest"]:
        return "pytest"
    if words[0] == "torchrun" or words[0] in PYTHONS:
        script = next(w for w in words[1:] if w.endswith(".py"))
        argv = words[words.index(script) + 1:]
        assert os.path.isfile(os.path.join(REPO, script)), command
        if script in ENTRY:
            from megatron_ext import arguments

            arguments.parse(argv, world_size=world_of(words), family=ENTRY[script])
            return "entry"
        parse_tool(script, argv)
        return "tool"
    return "other"


@pytest.mark.parametrize("page, command", ALL, ids=[f"{p}:{i}" for i, (p, _) in enumerate(ALL)])
def test_every_documented_command_runs_or_parses(page, command, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert check(command, tmp_path) != "other" or command.split()[0] in ("cat", "ls", "export", "cd", "pip",
                                                                         "git", "nvidia-smi", "tensorboard", "huggingface-cli"), command
