"""megatron_ext: Qwen2/2.5, ViT and GPT-2 training on megatron-core and DeepSpeed."""

from megatron_ext import cli
from megatron_ext.platform import imports, quiet

quiet.install()
imports.install()
cli.hold_stop_signals()  # a rank under megatron_ext.launch: SIGTERM/SIGUSR1 before its loop are held, not fatal
