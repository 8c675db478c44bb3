"""megatron_ext: Qwen2/2.5, ViT and GPT-2 training on megatron-core and DeepSpeed."""

from megatron_ext.platform import quiet

quiet.install()
