"""The floor plan: megatron_ext's imports only run downward, and there are no import circles.

Layers, bottom up: errors and platform shims; the mesh, process groups and config sections; models, data and what a
run records (observability); checkpoints and conversion; engines; objectives; training, evaluation and the flags;
launch. Offline ``analysis/`` sits beside tools/, above the package: it imports megatron_ext, never the reverse.
Every import counts, also one inside a function (a lazy import is still a dependency). Read from the source (AST),
so a bad edge is named with its file and line.
"""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS = [
    ("errors", "flag_types", "megatron_lm_flags", "platform", "cli"),
    ("mesh", "parallel", "config"),
    ("models", "data", "observability"),
    ("checkpoint", "convert"),
    ("engines",),
    ("objectives",),
    ("training", "evaluation", "arguments"),
    ("launch",),
]


def modules() -> dict:
    out = {}
    for top, _, files in os.walk(os.path.join(REPO, "megatron_ext")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(top, name)
                module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                out[module] = path
    return out


def imports(mods: dict) -> dict:
    """module -> [(imported module, line)] for megatron_ext's own modules."""
    edges = {}
    for module, path in mods.items():
        found = []
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_ext"):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    found.append((target if target in mods else node.module, node.lineno))
            elif isinstance(node, ast.Import):
                found += [(a.name, node.lineno) for a in node.names if a.name.startswith("megatron_ext")]
        edges[module] = [(t, line) for t, line in found if t != module and t != "megatron_ext"]
    return edges


def layer(module: str) -> int:
    part = module.split(".")[1]
    return next(i for i, names in enumerate(LAYERS) if part in names)


def test_every_module_has_a_layer():
    assert [m for m in modules() if m != "megatron_ext" and not any(m.split(".")[1] in n for n in LAYERS)] == []


def test_imports_only_run_downward():
    upward = [f"{mods[m]}:{line} ({m}) imports {t}" for mods in [modules()] for m, targets in imports(mods).items()
              if m != "megatron_ext" for t, line in targets if layer(t) > layer(m)]
    assert upward == []


def test_no_import_circles():
    edges = {m: {t for t, _ in targets} for m, targets in imports(modules()).items()}
    done, stack, circles = set(), [], []

    def visit(m):
        if m in stack:
            circles.append(" -> ".join(stack[stack.index(m):] + [m]))
            return
        if m in done:
            return
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            visit(t)
        stack.pop()
        done.add(m)

    for m in sorted(edges):
        visit(m)
    assert circles == []


def test_the_rules_the_floor_plan_names():
    """Models never read flags; engines never reach up into objectives or training; nothing imports Mesh from the
    flags."""
    edges = imports(modules())
    assert not [m for m, ts in edges.items() if m.startswith("megatron_ext.models") and
                any(t.startswith("megatron_ext.arguments") for t, _ in ts)]
    assert not [m for m, ts in edges.items() if m.startswith("megatron_ext.engines") and
                any(t.startswith(("megatron_ext.training", "megatron_ext.objectives")) for t, _ in ts)]
    import re

    pattern = re.compile(r"from megatron_ext\.arguments import[^\n]*\bMesh\b")
    sources = [os.path.join(top, f) for d in ("megatron_ext", "tests", "tools", "bench")
               for top, _, files in os.walk(os.path.join(REPO, d)) for f in files if f.endswith(".py")]
    assert [p for p in sources if pattern.search(open(p).read())] == []


def test_analysis_stays_outside_the_package():
    """megatron_ext never imports the top-level ``analysis``; of this repo's code, analysis imports megatron_ext only
    (not tools/, bench/, tests/ or an entry script)."""
    def tops(top_dir):
        for top, _, files in os.walk(os.path.join(REPO, top_dir)):
            for path in (os.path.join(top, f) for f in files if f.endswith(".py")):
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                        yield path, node.lineno, node.module.split(".")[0]
                    elif isinstance(node, ast.Import):
                        yield from ((path, node.lineno, a.name.split(".")[0]) for a in node.names)

    assert [f"{p}:{line}" for p, line, top in tops("megatron_ext") if top == "analysis"] == []
    local = {name.removesuffix(".py") for name in os.listdir(REPO)} - {"megatron_ext", "analysis"}
    assert [f"{p}:{line} imports {top}" for p, line, top in tops("analysis") if top in local] == []
