"""Qwen's own flags, as typed sections: the model (preset, config, layers, spec), PEFT adapters in and out, and the
SFT data; the shape from them. Torch-free: everything here runs before any process group exists."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from megatron_ext.config import Section, option
from megatron_ext.data import chat
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import nonneg_int, positive_int, shipped, split_weights
from megatron_ext.models import moe_flags
from megatron_ext.models.qwen.shape import PRESETS, ModelShape, shape_from_hf_config

LORA_GROUP = "LoRA (frozen base, trained adapters and head)"
SAMPLE = "examples/data/metamathqa_sample.jsonl"


@dataclasses.dataclass
class QwenModel(Section):
    GROUP = "model"
    model: Optional[str] = option(None, choices=sorted(PRESETS),
                                  help="published Qwen2.5/Qwen3 shape or 'tiny' (default; with --pretrained: its config)")
    hf_config: Optional[str] = option(None, help="build from a Hugging Face Qwen2/Qwen3 (or MoE) config.json "
                                                 "(overrides --model)")
    num_layers: Optional[int] = option(None, type=positive_int, help="override the preset's layer count")
    transformer_impl: str = option("local", choices=["local", "transformer_engine"],
                                   help="local: our SDPA attention + torch norms; transformer_engine: TE's spec "
                                        "(needs TE)")
    make_vocab_size_divisible_by: int = option(128, type=positive_int)

    def check(self, run) -> None:
        if self.transformer_impl == "transformer_engine":
            try:
                import transformer_engine  # noqa: F401
            except ImportError:
                raise ConfigError("--transformer-impl transformer_engine needs TransformerEngine installed; "
                                  "use --transformer-impl local") from None

    def shape(self, training, moe: moe_flags.MoESettings) -> ModelShape:
        """The preset's or config's shape, then the MoE flags'."""
        shape = shape_from_hf_config(self.hf_config) if self.hf_config else PRESETS[self.model or 'tiny']
        if self.num_layers is not None:
            shape = dataclasses.replace(shape, num_layers=self.num_layers)
        return moe.shape(shape)


@dataclasses.dataclass
class Adapters(Section):
    """PEFT adapters in and out (beside the LoRA flags, in their group)."""

    GROUP = LORA_GROUP
    pretrained_adapter: Optional[str] = option(None, metavar="DIR",
                                               help="start the adapters from a PEFT LoRA adapter (ours or one trained "
                                                    "with peft) for --pretrained")
    save_peft: Optional[str] = option(None, metavar="DIR",
                                      help="at the end, the adapters as a PEFT LoRA adapter "
                                           "(peft.PeftModel.from_pretrained loads it)")


@dataclasses.dataclass
class QwenData(Section):
    GROUP = "data"
    data_path: List[str] = option([SAMPLE], nargs="+",
                                  help="a datasets hub id (meta-math/MetaMathQA) or a local .json/.jsonl/.parquet; "
                                       "several with weights: 0.7 a.jsonl 0.3 b.jsonl")
    mock_data: bool = option(False, help="synthetic token sequences instead of --data-path")
    tokenizer: Optional[str] = option(None, help="Hugging Face tokenizer dir or id (default: --pretrained's, else "
                                                 "examples/tokenizers/tiny-qwen)")
    data_split: str = option("98,2", type=split_weights, help="train,validation weights of the records")
    system_prompt: Optional[str] = option(None)
    data_format: str = option("auto", choices=list(chat.FORMATS),
                              help="auto: by each row's columns (query/response, instruction/output, conversations, "
                                   "messages, prompt/completion)")
    data_columns: Optional[str] = option(None, help="rename columns, e.g. query=question,response=answer (names: "
                                                    + ",".join(chat.COLUMNS) + ")")
    data_role_tags: Optional[str] = option(None, help="ShareGPT tags, e.g. role_tag=from,content_tag=value,"
                                                      "user_tag=human,assistant_tag=gpt")
    loss_on: str = option("assistant", choices=list(chat.LOSS_ON),
                          help="train every assistant turn, only the last, or every token")
    pack_sequences: bool = option(False, help="concatenate examples to --seq-length; attention and positions restart "
                                              "per example")
    bad_rows: str = option("skip", choices=["skip", "error"])
    data_cache_dir: Optional[str] = option(None, help="tokenized-data cache (default: beside the data)")
    eval_generate_samples: int = option(0, type=nonneg_int,
                                        help="at every evaluation, math accuracy of greedy answers (up to 512 tokens) "
                                             "to N held-out problems (validation rows with '#### N', \\boxed{} or 'The "
                                             "answer is: X'); 0 disables")

    @staticmethod
    def shipped() -> dict:
        """The defaults the repository ships, found from the working directory of this parse (flag_types.shipped)."""
        return dict(data_path=[shipped(SAMPLE)])

    row_format: Optional[dict] = option(None, cli=False)  # how rows are read (data/chat.row_format)
    mixture: Optional[list] = option(None, cli=False)  # [(weight, path)]

    def check(self, run) -> None:
        """How rows are read and which data sets mix, checked now and used by the data build."""
        from megatron_ext.data import mixture

        self.row_format = chat.row_format(self.data_format, self.data_columns, self.data_role_tags)
        self.mixture = mixture.parse(self.data_path)  # (then one data set reads as its path, as checkpoints record it)
        self.data_path = self.data_path[0] if len(self.data_path) == 1 else self.data_path
        if self.eval_generate_samples and (self.mock_data or not run.training.eval_interval):
            raise ConfigError(f"--eval-generate-samples {self.eval_generate_samples} answers held-out rows of "
                              "--data-path at every evaluation: " + (
                                  "drop --mock-data" if self.mock_data else "give --eval-interval N too"))

    def check_files(self) -> None:
        from megatron_ext.data import rows

        for _, path in self.mixture:
            rows.check_path(path)
