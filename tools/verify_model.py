"""Prove a model before spending GPU hours: build it exactly as training would and print a parity card.

    python tools/verify_model.py --pretrained Qwen/Qwen2.5-0.5B
    python -m megatron_ext.launch --nproc-per-node 4 tools/verify_model.py --pretrained Qwen/Qwen3-8B --bf16 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 4 --card-json card.json
    python tools/verify_model.py --pretrained google/vit-base-patch16-224-in21k --num-classes 101

Takes the training flags of the model's entry script (finetune_qwen.py: Qwen2/2.5, Qwen2-MoE, Qwen3, Qwen3-MoE;
pretrain_gpt.py: GPT-2; pretrain_vit.py: ViT): mesh, engine, dtype, --lora-*, MoE flags, --num-classes;
``--pretrained-adapter DIR`` (a PEFT LoRA adapter) compares with transformers + PEFT on it, and the export (adapters
folded in) with PEFT's own merge;
``--num-layers N`` checks the first N layers of a large model (transformers then loads only those). On one fixed
batch (two chat-template conversations; GPT-2: their text; ViT: seeded random images) the card compares with
transformers: logits (max and mean absolute difference), per-token (per-image) loss, top-1 agreement, the parameter
count; a ViT head the run starts afresh (an in21k backbone, another class count) is checked on what it reads, the
class token's features. Then one lr-0 optimizer step, whose loss must be the forward's, and the --save-hf export in
the run's dtype, which must give back every source tensor (cast to that dtype) bit for bit. Exit status: 0 when
every row passes, 1 when one fails, 2 (one line) for what it cannot check.
"""

import gc
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.cli import run_main  # noqa: E402
from megatron_ext.errors import ConfigError, TrainingStopped  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "What is 17 * 23? Explain briefly."},
     {"role": "assistant", "content": "17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 = 391. The answer is 391."}],
    [{"role": "system", "content": "You are a careful assistant."},
     {"role": "user", "content": "Name three prime numbers larger than 10."},
     {"role": "assistant", "content": "Three primes above 10 are 11, 13 and 17."}],
]
DEFAULTS = {"--seq-length": "64", "--micro-batch-size": "1", "--train-iters": "1", "--lr": "0",
            "--lr-warmup-iters": "0"}


def parse(argv):
    from megatron_ext.flag_types import Parser  # (its errors are one line)

    own = Parser(description=__doc__.splitlines()[0], add_help=False, allow_abbrev=False)
    own.add_argument("--card-json", default=None, help="also write the card as JSON here")
    own.add_argument("--pretrained", default=None, help="a hub id or a Hugging Face directory")
    known, rest = own.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        own.print_help()
        print("\nand the training flags of the source's entry script: finetune_qwen.py (Qwen2/2.5, Qwen3, MoE), "
              "pretrain_gpt.py (GPT-2), pretrain_vit.py (ViT); python SCRIPT --help lists them")
        sys.exit(0)
    if known.pretrained is None:
        raise ConfigError("tools/verify_model.py checks a model against transformers: give --pretrained (a hub id, a "
                          "Hugging Face directory)")
    for flag in ("--objective", "--data-path", "--pack-sequences", "--save", "--load", "--save-hf"):
        if flag in rest:
            raise ConfigError(f"tools/verify_model.py: {flag} is not checked here (it runs a fixed batch and exports "
                              "to a temporary directory); drop it")
    from megatron_ext import arguments

    family = family_of(known.pretrained)
    rest = rest + ["--pretrained", known.pretrained]  # (the entry's flag too)
    extra = [a for flag, value in DEFAULTS.items() if flag not in rest and not (family == "vit" and flag ==
             "--seq-length") for a in (flag, value)]  # (a ViT's sequence is its patches)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # the mesh (a global batch every DP size divides, with enough micro-batches for an interleaved schedule)
    probe = arguments.parse(rest + extra + ["--mock-data", "--global-batch-size", str(world * max(world, 2))],
                            world_size=world, family=family)
    # the two conversations (or four images), repeated: a multiple of PP (the interleaved schedule)
    per_rank = (4 if family == "vit" else 2) * probe.mesh.pp
    run = arguments.parse(rest + extra + ["--mock-data", "--global-batch-size", str(per_rank * probe.mesh.dp)],
                          world_size=world, family=family)
    if run.pretrained.source is None or run.pretrained.source.kind == "ours":
        raise ConfigError(f"--pretrained {run.pretrained.pretrained}: tools/verify_model.py compares with transformers, "
                          "so it needs a Hugging Face model (a hub id or directory); export ours first "
                          "(tools/convert_mcore_to_hf.py)")
    return known, run, per_rank, family


def family_of(name: str) -> str:
    """The entry script's family of a --pretrained source (its config.json's model_type)."""
    from megatron_ext.convert import source
    from megatron_ext.models import families

    # a hub id that cannot be read says so here; a bad local path, in the entry's own parse
    path = os.path.join(name, "config.json") if os.path.isdir(name) else \
        source._hub_config(name) if source.is_hub_id(name) else None
    model_type = json.load(open(path)).get("model_type") if path and os.path.isfile(path) else None
    return families.family_of(model_type)


class Texts:
    """A language model's check: the conversations (GPT-2: their text) as [rows, seq] tokens with the assistant's
    loss mask, against AutoModelForCausalLM."""

    unit = "token"

    def __init__(self, run, rows: int, family: str):
        import torch

        from megatron_ext.data import chat
        from megatron_ext.data.tokenizer import load_tokenizer

        data, seq = run.data, run.training.seq_length
        tokenizer = load_tokenizer(data.tokenizer, chat=family != "gpt")
        if family == "gpt":
            texts = [" ".join(m["content"] for m in CONVERSATIONS[i % 2]) for i in range(rows)]
            out = [(ids, [1] * len(ids)) for ids in tokenizer(texts)["input_ids"]]
        else:
            out = chat.tokenize_conversations(tokenizer, [(CONVERSATIONS[i % 2], None) for i in range(rows)],
                                              "assistant")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ids = torch.full((rows, seq + 1), pad, dtype=torch.long)
        mask = torch.zeros(rows, seq + 1)
        for i, (row_ids, row_mask) in enumerate(out):
            n = min(len(row_ids), seq + 1)
            ids[i, :n], mask[i, :n] = torch.tensor(row_ids[:n]), torch.tensor(row_mask[:n], dtype=torch.float)
        self.tokens, self.labels, self.mask = ids[:, :-1], ids[:, 1:], mask[:, 1:]
        if int(self.labels.max()) >= run.shape.vocab_size:
            raise ConfigError(f"--tokenizer {data.tokenizer} gives token ids up to {int(self.labels.max())}, beyond "
                              f"the model's {run.shape.vocab_size}-token vocabulary; give the model's own tokenizer")
        self.microbatches = [dict(tokens=self.tokens[i:i + 1], labels=self.labels[i:i + 1],
                                  loss_mask=self.mask[i:i + 1], position_ids=torch.arange(seq)[None])
                             for i in range(rows)]
        self.model_kwargs, self.vocab_size, self.note = {}, run.shape.vocab_size, ""

    def outputs(self, chunks):
        from megatron_ext.convert import verify

        return verify.logits(chunks, self.tokens, self.vocab_size)

    def against(self, directory: str, dtype, layers: dict, ours, adapter=None):
        """The rows against transformers (with ``adapter``: PEFT's model of it on top), its loss on the batch and
        its parameter count (the adapters' left out, as ours)."""
        import torch
        from transformers import AutoModelForCausalLM

        from megatron_ext.convert import verify

        reference = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **layers).eval()
        count = sum(p.numel() for p in reference.parameters())
        if adapter:
            from peft import PeftModel

            reference = PeftModel.from_pretrained(reference, adapter).eval()
        with torch.no_grad():
            theirs = reference(input_ids=self.tokens).logits.float()
        loss = (torch.nn.functional.cross_entropy(theirs.transpose(1, 2), self.labels, reduction="none")
                * self.mask).sum() / self.mask.sum()
        return verify.compare(ours, theirs, self.labels, self.mask, dtype, self.unit), loss.item(), count

    def same_names(self, exported: dict, source: dict):
        return exported, source


class Images:
    """A ViT's check: seeded random images and labels, against ViTForImageClassification; a head the run starts
    afresh (a backbone such as google/vit-*-in21k, or another --num-classes) is checked on what it reads, the class
    token's features, against ViTModel."""

    unit = "image"

    def __init__(self, run, rows: int, family: str):
        import torch

        from megatron_ext.convert.common import SafetensorsReader
        from megatron_ext.models.vit import model as vit

        model, shape = run.model, run.shape
        reader = SafetensorsReader(run.pretrained.source.directory, "--pretrained")
        theirs = reader.get("classifier.weight").shape[0] if "classifier.weight" in reader.names() else None
        self.classes = model.num_classes or theirs or 10
        self.new_head, self.seq_length, self.label_smoothing = self.classes != theirs, shape.seq_length, \
            model.label_smoothing
        self.prefixed = any(name.startswith("vit.") for name in reader.names())
        generator = torch.Generator().manual_seed(run.training.seed)
        self.pixels = torch.randint(0, 256, (rows, shape.num_channels, shape.image_size, shape.image_size),
                                    dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(0, self.classes, (rows,), generator=generator)
        # what training feeds the model: the loader's bytes, normalised as vit.forward_step does
        self.normalised = vit.device_pixels(self.pixels, shape.image_size, **vit.normalization(model.hf_config))
        self.microbatches = [dict(pixels=self.pixels[i:i + 1], labels=self.labels[i:i + 1], loss_mask=torch.ones(1))
                             for i in range(rows)]
        self.model_kwargs, self.vocab_size = dict(num_classes=self.classes), None
        self.head_size = self.classes * (shape.hidden_size + 1)
        self.note = f", a new {self.classes}-class head" if self.new_head else ""

    def outputs(self, chunks):
        from megatron_ext.convert import verify

        return verify.image_outputs(chunks, self.normalised, self.seq_length, features=self.new_head)

    def against(self, directory: str, dtype, layers: dict, ours):
        import torch
        from transformers import ViTForImageClassification, ViTModel

        from megatron_ext.convert import verify

        pixels = self.normalised.to(dtype)
        if self.new_head:  # nothing to compare the new head with: what it reads, and the count without it
            reference = ViTModel.from_pretrained(directory, dtype=dtype, add_pooling_layer=False, **layers).eval()
            with torch.no_grad():
                theirs = reference(pixel_values=pixels).last_hidden_state[:, 0].float()
            return (verify.differences("class-token features", ours, theirs, dtype), None,
                    sum(p.numel() for p in reference.parameters()) + self.head_size)
        reference = ViTForImageClassification.from_pretrained(directory, dtype=dtype, **layers).eval()
        with torch.no_grad():
            theirs = reference(pixel_values=pixels).logits.float()
        loss = torch.nn.functional.cross_entropy(theirs, self.labels, label_smoothing=self.label_smoothing)
        return (verify.compare(ours, theirs, self.labels, torch.ones(len(self.labels)), dtype, self.unit),
                loss.item(), sum(p.numel() for p in reference.parameters()))

    def same_names(self, exported: dict, source: dict):
        """The export (ViTForImageClassification's names) and the source on the same names; a new head is not the
        source's."""
        if self.new_head:
            exported, source = ({k: v for k, v in d.items() if not k.startswith("classifier.")}
                                for d in (exported, source))
        if not self.prefixed:  # a ViTModel backbone's names have no "vit." prefix
            exported = {k[len("vit."):] if k.startswith("vit.") else k: v for k, v in exported.items()}
        return exported, source


def main(argv=None):
    known, run, rows, family = parse(sys.argv[1:] if argv is None else argv)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext.convert import export, verify
    from megatron_ext.models import families
    from megatron_ext.models.spec import params_dtype
    from megatron_ext.objectives import base, sft
    from megatron_ext.training.run import build_model, start

    device = start(run)
    source = run.pretrained.source
    with open(source.config_path) as f:
        hf_config = json.load(f)
    total = hf_config.get("num_hidden_layers", hf_config.get("n_layer"))
    run.pretrained.first_layers = run.shape.num_layers < total  # the loader then reads only those
    subject = (Images if family == "vit" else Texts)(run, rows, family)
    built = families.FAMILIES[family].build(run, run.shape, device, **subject.model_kwargs)  # as its entry script's
    objective = base.FamilyStep(built.pop("step_func", sft.forward_step), new_head=built.pop("new_head", ()))
    engine, chunks, model_meta = build_model(run, device=device, objective=objective, **built)  # (a ViT's: classes)
    dtype = params_dtype(run)

    ours = subject.outputs(engine.forward_modules)  # (any engine's model chunks)
    count = verify.parameter_count(engine.forward_modules, subject.vocab_size)
    # the training path (forward and backward) gives the forward's loss; no optimizer step, so no optimizer state:
    # the card's peak is the model, its gradients and then the reference (the export below is still the source)
    forward = engine.forward_backward(subject.microbatches, forward_only=True)
    stepped = engine.forward_backward(subject.microbatches)
    first = ours is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0 \
        and ps.get_data_parallel_rank() == 0  # the last stage's first rank holds what rank 0 compares
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (ours, forward, stepped) if first else None)
    ours, forward, stepped = next(part for part in everyone if part is not None)
    # the export goes beside the working directory (every node writes its part there), and is removed after
    shared = [tempfile.mkdtemp(dir=os.getcwd(), prefix=".verify_model.") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    out = os.path.join(shared[0], "hf")
    try:
        export.save_hf(engine, out, model_meta=model_meta, dtype=dtype, lora=run.lora is not None)  # (a card row)
        del engine, chunks  # ours are all measured: rank 0's reference takes their place in memory
        gc.collect()
        code = card(known, run, subject, total, hf_config, ours, count, forward, stepped, out, dtype) \
            if dist.get_rank() == 0 else 0
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(shared[0], ignore_errors=True)
    from megatron_ext import parallel

    parallel.teardown()
    if code:  # rank 0's card failed: its last line (under megatron_ext.launch, the launcher's)
        raise TrainingStopped("verify_model: the card fails (its rows above): the model is not the one transformers "
                              "loads")


def card(known, run, subject, total, hf_config, ours, count, forward, stepped, exported, dtype) -> int:
    """Rank 0: transformers on the same batch and the same (first) layers, the rows, the card and its JSON."""
    import torch

    from megatron_ext.convert import verify
    from megatron_ext.models import families
    from megatron_ext.convert.pretrained import layer_of
    from megatron_ext.models.qwen.config import Adapters
    from megatron_ext.platform import quiet

    quiet.transformers_loading()  # the card says what was compared
    shape, source = run.shape, run.pretrained.source
    layers = {"num_hidden_layers": shape.num_layers} if shape.num_layers < total else {}
    adapter = getattr(run.section(Adapters), "pretrained_adapter", None)
    rows, theirs_loss, expected = subject.against(source.directory, dtype, layers, ours,
                                                  **(dict(adapter=adapter) if adapter else {}))
    rows.append(verify.Row("parameters (ours / transformers)", f"{count:,} / {expected:,}", "equal", count == expected))
    if theirs_loss is not None:
        band = verify.BANDS.get(dtype, verify.BANDS[torch.bfloat16])[4]
        rows.append(verify.Row("loss: ours - transformers", forward - theirs_loss, f"|.| <= {band:g}",
                               abs(forward - theirs_loss) <= band))
    rows.append(verify.Row("training path: loss - forward's", stepped - forward, "|.| <= 1e-6 x loss",
                           abs(stepped - forward) <= 1e-6 * abs(forward)))
    keep = (lambda name: layer_of(name) is None or layer_of(name) < shape.num_layers)
    model_type = hf_config["model_type"]
    ignorable = families.TABLES[model_type].ignorable  # (a tied model's repeated lm_head, old buffers, a pooler)
    # both sides read a tensor at a time (a large model's two copies are never all in memory)
    read = merged(source.directory, adapter, dtype, layers) if adapter else \
        verify.read_tensors(source.directory, lazy=True)
    source_tensors = verify.in_dtype({k: v for k, v in read.items() if keep(k) and not ignorable(k, shape)}, dtype)
    pair = subject.same_names(verify.read_tensors(exported, lazy=True), source_tensors)
    problem = verify.merged_round_trip(*pair) if adapter else verify.exact_round_trip(*pair)
    rows.append(verify.Row("--save-hf round trip", ("= PEFT's merge" if adapter else "bit-exact") if problem is None
                           else problem, ("= PEFT's merge_and_unload" if adapter else "= source") +
                           f" in {str(dtype).replace('torch.', '')}", problem is None))
    layers = f"{shape.num_layers} of {total} layers" if shape.num_layers < total else f"{total} layers"
    engine = "" if run.engine.engine == "megatron" else f" under --engine {run.engine.engine}" + (
        f" (ZeRO-{run.engine.zero_stage})" if run.engine.engine == "deepspeed" else "")
    name = run.pretrained.pretrained
    title = (f"verify_model: {name} ({model_type}, {layers}{subject.note}) on {run.mesh.describe()}"
             f"{engine}, {str(dtype).replace('torch.', '')}{', LoRA' if run.lora else ''}")
    print(verify.format_card(title, rows), flush=True)
    if known.card_json:
        verify.write_json(known.card_json, title, rows, dict(pretrained=name, mesh=run.mesh.describe()))
    return 0 if all(r.passed for r in rows) else 1


def merged(directory: str, adapter: str, dtype, layers: dict) -> dict:
    """The source with ``adapter`` folded in by PEFT itself (``merge_and_unload``), in ``dtype``, by tensor name."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **layers)
    return {k: v.detach().clone() for k, v in PeftModel.from_pretrained(model, adapter).merge_and_unload()
            .state_dict().items()}


if __name__ == "__main__":
    run_main(main)
