"""Options declared once: every flag of every entry point is one field of one typed section (its default, type and
help beside it), and a parsed command line is those sections."""

import dataclasses

import pytest

from megatron_ext import arguments, config
from megatron_ext.config import Section, option
from megatron_ext.errors import ConfigError
from megatron_ext.flag_types import Parser, positive_int

FAMILIES = ("qwen", "vit", "gpt")


def sections():
    out, todo = [], list(Section.__subclasses__())
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += cls.__subclasses__()
    return [cls for cls in out if dataclasses.is_dataclass(cls) and cls.__module__.startswith("megatron_ext")]


def declared_in(cls, name: str):
    """The class whose body declares field ``name`` (a base's field, inherited, is declared once)."""
    return next(c for c in reversed(cls.__mro__) if name in vars(c).get("__annotations__", {}))


def owners(dest: str, among=None):
    return sorted({(declared_in(cls, f.name).__name__, f.name) for cls in among or sections()
                   for f in dataclasses.fields(cls)
                   if "option" in f.metadata and f.metadata["option"]["cli"] and config._dest(f) == dest})


@pytest.mark.parametrize("family", FAMILIES)
def test_every_flag_is_one_section_field(family):
    """A flag added with a bare add_argument, or declared in two sections, fails here."""
    parser = arguments.build_parser(family=family)
    stray = {a.dest: owners(a.dest, parser.sections) for a in parser._actions
             if a.dest != "help" and len(owners(a.dest, parser.sections)) != 1}
    assert stray == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_defaults_are_the_fields(family):
    """What the parser fills in when no flag is given is the field's own default (declared once)."""
    parser, seen = arguments.build_parser(family=family), 0
    for action in parser._actions:
        for name, field in owners(action.dest, parser.sections):
            spec = next(f for cls in parser.sections for f in dataclasses.fields(cls)
                        if f.name == field and declared_in(cls, field).__name__ == name)
            default = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
            if action.default != default:  # a shipped file resolved against the repository keeps its name
                assert str(action.default).endswith(str(default).strip("[]'")), (action.dest, action.default)
            seen += 1
    assert seen > 100 if family == "qwen" else seen > 60


def test_a_section_is_its_flags():
    @dataclasses.dataclass
    class Probe(Section):
        GROUP = "probe"
        count: int = option(1, type=positive_int, help="how many")
        quiet: bool = option(False)
        fused: bool = option(True, flags=("--no-fusion",))
        mode: str = option("a", flags=("--probe-mode", "--probe_mode"), choices=("a", "b"))
        bf16: bool = option(False, exclusive="precision")
        fp16: bool = option(False, exclusive="precision")
        derived: int = option(0, cli=False)

    parser = Parser()
    config.add_arguments(parser, [Probe])
    probe = config.from_namespace(Probe, parser.parse_args(
        ["--count", "3", "--quiet", "--no-fusion", "--probe_mode", "b", "--fp16"]))
    assert probe == Probe(count=3, quiet=True, fused=False, mode="b", bf16=False, fp16=True, derived=0)
    assert config.from_namespace(Probe, parser.parse_args([])) == Probe()
    assert "--derived" not in parser.format_help() and "how many" in parser.format_help()
    with pytest.raises(ConfigError, match="^--count must be >= 1, got 0$"):
        parser.parse_args(["--count", "0"])
    with pytest.raises(ConfigError, match="not allowed with argument"):
        parser.parse_args(["--bf16", "--fp16"])


def test_a_run_is_its_sections():
    """The run holds sections; what the checks derive (the global batch, the schedule's length) lands in them."""
    run = arguments.parse("--train-iters 7 --micro-batch-size 2 --lr 3e-4 --tensor-model-parallel-size 2".split(),
                          world_size=4)
    assert (run.training.global_batch_size, run.training.num_microbatches, run.optimizer.decay_iters) == (4, 1, 7)
    assert (run.parallel.tp, run.mesh.dp, run.optimizer.lr, run.engine.engine) == (2, 2, 3e-4, "megatron")
    assert run.flags()["lr"] == 3e-4 and run.flags()["tensor_model_parallel_size"] == 2 and run.flags()["model"] == "tiny"
