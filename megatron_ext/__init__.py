"""megatron_ext: Qwen2/2.5, ViT and GPT-2 training on megatron-core and DeepSpeed."""

import os
import signal

from megatron_ext.cli import STATUS_DIR
from megatron_ext.platform import imports, quiet

quiet.install()
imports.install()
if os.environ.get(STATUS_DIR):  # a rank under megatron_ext.launch: a USR1 before the training loop
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # handles it must not kill it (the launcher passes USR1 on)
