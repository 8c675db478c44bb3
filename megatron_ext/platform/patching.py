"""Rewrite a megatron-core function from its own source with exact text replacements.

For fixes and adaptations that no module attribute can reach (a tensor-type check, a scale inside a method): the
replacement fails loudly when the text is gone, so a megatron-core upgrade cannot silently skip a fix.
"""

from __future__ import annotations

import inspect
import sys
import textwrap

MEGATRON_PREFIX = "megatron.core"

PATCHED: dict = {}


def replace_in_source(owner, attr: str, replacements) -> None:
    """Recompile ``owner.attr`` with each (old, new) text replaced in its source; fail loudly if an ``old`` is gone.

    The source is compiled inside a function that binds ``__class__``, so zero-argument ``super()`` in a patched
    method still resolves to ``owner``.
    """
    raw = inspect.getattr_static(owner, attr)
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    source = textwrap.dedent(inspect.getsource(fn))
    for old, new in replacements:
        if old not in source:
            raise RuntimeError(f"megatron_ext: {fn.__qualname__} no longer contains {old!r}; megatron-core "
                               "changed, update the patch (megatron_ext/platform/cpu.py, models/moe.py)")
        source = source.replace(old, new)
    maker = f"def _make(__class__):\n{textwrap.indent(source, '    ')}\n    return {fn.__name__}\n"
    namespace: dict = {}
    exec(compile(maker, inspect.getsourcefile(fn), "exec"), fn.__globals__, namespace)
    patched = namespace["_make"](owner if isinstance(owner, type) else None)  # decorators are part of the source
    PATCHED[f"{fn.__module__}.{fn.__qualname__}"] = patched
    setattr(owner, attr, patched)
    # Modules that did ``from ... import fn`` hold the old function: rebind those names too.
    for name, module in list(sys.modules.items()):
        if name.startswith(MEGATRON_PREFIX) and module is not None:
            for key, value in list(vars(module).items()):
                if value is raw:
                    setattr(module, key, patched)
