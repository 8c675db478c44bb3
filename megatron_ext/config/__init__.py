"""Options declared once: each is a field of a typed section (a dataclass), with its default, type, help and flag
names beside it; the command line is generated from the fields and a parsed command line becomes the sections.

    @dataclasses.dataclass
    class Reliability(Section):
        GROUP = "reliability (preemption, bad steps, hangs)"
        on_nan: str = option("stop", choices=("stop", "skip"), help="...")

    def check(self, run): ...   # cross-section checks, one-line ConfigError naming the flag

A field's flag is ``--`` + its name with dashes (``on_nan`` -> ``--on-nan``) unless ``flags`` names others
(Megatron-LM's spellings, aliases). Booleans are switches: ``False`` -> ``--name``; ``True`` -> ``--no-name``
(or ``negate=False`` for ``--name/--no-name``). Torch-free: everything here runs before any process group exists.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from typing import Any, ClassVar, Dict, Iterable, Optional, Sequence, Tuple, Type, TypeVar

_MISSING = dataclasses.MISSING
S = TypeVar("S", bound="Section")


def option(default: Any = None, *, flags: Sequence[str] = (), help: Optional[str] = None, type=None,
           choices: Optional[Iterable] = None, metavar: Optional[str] = None, nargs=None, exclusive: str = "",
           negate: Optional[bool] = None, cli: bool = True) -> Any:
    """A section field that is also a flag. ``exclusive``: fields sharing this name form a mutually exclusive group
    (``--bf16`` / ``--fp16``). ``negate=False`` on a boolean: ``--name/--no-name``. ``cli=False``: a field the run
    fills in (derived from others), never a flag."""
    spec = dict(flags=tuple(flags), help=help, type=type, choices=tuple(choices) if choices is not None else None,
                metavar=metavar, nargs=nargs, exclusive=exclusive, negate=negate, cli=cli)
    if isinstance(default, (list, dict, set)):  # a mutable default: each section its own copy
        return dataclasses.field(default_factory=lambda: copy.copy(default), metadata=dict(option=spec))
    return dataclasses.field(default=default, metadata=dict(option=spec))


class Section:
    """A typed group of options. ``GROUP``: its title in ``--help``. ``check(run)``: what needs other sections (the
    mesh, the engine), raising one-line ``ConfigError``s; checks of one value alone belong in the field's ``type``."""

    GROUP: ClassVar[str] = ""

    def check(self, run) -> None:  # noqa: B027 (most sections check nothing across sections)
        pass


def _fields(cls: Type[Section]):
    return [f for f in dataclasses.fields(cls) if "option" in f.metadata and f.metadata["option"]["cli"]]


def _dest(field: dataclasses.Field) -> str:
    """Where argparse puts a field's value: the field's name when one of its flags spells it (``--split`` and
    ``--data-split`` for ``data_split``), else its first flag's name (``--no-x`` -> ``x``), as argparse itself would
    name it, so ``--help`` reads as before and a field may carry a shorter name than its flag."""
    names = [name.lstrip("-").removeprefix("no-").replace("-", "_") for name in field.metadata["option"]["flags"]]
    return field.name if not names or field.name in names else names[0]


def _default(field: dataclasses.Field):
    return field.default_factory() if field.default is _MISSING else field.default


def flag_of(cls: Type[Section], name: str) -> str:
    """The flag that sets field ``name`` (for messages)."""
    spec = next(f for f in dataclasses.fields(cls) if f.name == name).metadata["option"]
    return spec["flags"][0] if spec["flags"] else "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, sections: Iterable[Type[Section]]) -> None:
    """Every field of ``sections`` as a flag, grouped by section (one group per title)."""
    groups: Dict[str, Any] = {}
    added = set()  # a base's field that several sections inherit is one flag
    sections = list(sections)
    parser.sections = getattr(parser, "sections", []) + sections  # what the command line becomes
    for cls in sections:
        group = groups.get(cls.GROUP) or groups.setdefault(cls.GROUP, parser.add_argument_group(cls.GROUP or None))
        exclusive: Dict[str, Any] = {}
        for field in _fields(cls):
            if _dest(field) in added:
                continue
            added.add(_dest(field))
            spec, default = field.metadata["option"], _default(field)
            target = group
            if spec["exclusive"]:
                target = exclusive.get(spec["exclusive"]) or exclusive.setdefault(
                    spec["exclusive"], group.add_mutually_exclusive_group())
            dashed = "--" + field.name.replace("_", "-")
            kwargs = dict(dest=_dest(field), default=default, help=spec["help"])
            if spec["negate"] is False:  # --name / --no-name (a default of None: neither given)
                kwargs["action"] = argparse.BooleanOptionalAction
                names = spec["flags"] or (dashed,)
            elif isinstance(default, bool) and spec["type"] is None:
                kwargs["action"] = "store_false" if default else "store_true"
                names = spec["flags"] or (("--no-" + field.name.replace("_", "-")) if default else dashed,)
            else:
                names = spec["flags"] or (dashed,)
                for key in ("type", "choices", "metavar", "nargs"):
                    if spec[key] is not None:
                        kwargs[key] = spec[key]
            target.add_argument(*names, **kwargs)


def from_namespace(cls: Type[S], namespace: argparse.Namespace) -> S:
    """The section ``cls`` holding the parsed values of its flags (fields the namespace lacks keep their defaults;
    ``cli=False`` fields theirs, until a check fills them in)."""
    values = {f.name: getattr(namespace, _dest(f)) for f in _fields(cls) if hasattr(namespace, _dest(f))}
    return cls(**values)


def flags(sections: Iterable[Section]) -> Dict[str, Any]:
    """Every option of ``sections`` by its flag's name (a derived field by its own): what a run's summary and logger
    record."""
    out: Dict[str, Any] = {}
    for section in sections:
        for field in dataclasses.fields(section):
            if "option" in field.metadata:
                out[_dest(field)] = getattr(section, field.name)
    return out


__all__: Tuple[str, ...] = ("Section", "option", "add_arguments", "from_namespace", "flags", "flag_of")
