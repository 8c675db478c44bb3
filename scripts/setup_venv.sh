#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned CPU stack and megatron_ext installed editable.
# Idempotent: a stamp of requirements.txt + pyproject.toml makes a second run return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
stamp="$venv/.megatron_ext-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
python=$(command -v python3.11 || command -v python3)
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 11), "megatron_ext pins megatron-core 0.16.1: use Python 3.11"'
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# pip compiles what it installs one file at a time (half the set-up on 2 cores): compileall does it on every core
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile)
echo "megatron_ext: installing the pinned stack into $venv (first time: about 2 minutes)" >&2
# torch first (the local CPU wheel), then everything else, then DeepSpeed built against that torch.
"${pip[@]}" "$(grep '^torch==' requirements.txt)" 2>&1 | grep -v 'is ignored' >&2 || true
grep -v '^deepspeed==' requirements.txt > "$venv/.requirements-no-deepspeed.txt"
"${pip[@]}" -r "$venv/.requirements-no-deepspeed.txt" 2>&1 | grep -v 'is ignored' >&2 || true
"${pip[@]}" --no-build-isolation "$(grep '^deepspeed==' requirements.txt)" 2>&1 | grep -v 'is ignored' >&2 || true
"${pip[@]}" --no-deps --no-build-isolation -e . 2>&1 | grep -v 'is ignored' >&2 || true
# Not what no run imports: transformers' other model families (peft and trl import bloom's and encoder_decoder's),
# test suites, pip. Everything imported must be here: with PYTHONDONTWRITEBYTECODE (set on CI machines) a module
# compiled on import is compiled again by every process.
skip='/(transformers/models/(?!(auto|bloom|encoder_decoder|gpt2|qwen2|qwen2_moe|qwen3|qwen3_moe|vit)/)[^/]+/|tests/|pip/)'
"$venv/bin/python" -m compileall -q -j 0 -x "$skip" \
  "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  > /dev/null 2>&1 || true  # (a few packages ship files that are not Python 3: left as they are)
# Fail here, not in the first test, if anything is missing. megatron_ext first: its filters keep megatron-core's and
# DeepSpeed's import notices off a new user's first screen (tests/repo/test_repo.py runs this line).
"$venv/bin/python" -c 'import megatron_ext, torch, megatron.core, deepspeed, transformers, peft, datasets, safetensors, pytest, xdist'
echo "$want" > "$stamp"
