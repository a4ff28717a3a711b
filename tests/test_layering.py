"""Imports point one way: scripts -> recipes -> hetero (tools -> planner -> training -> export -> build ->
checkpoint, rundir -> optim -> runtime, parallel) -> runspec, checkpoint/source -> data -> models -> hetero/plan
(pure descriptions), and never in a cycle. Each hetero/ package is one concern; its __init__ says what it owns.

Every file's imports are read with ast, function-level (lazy) imports included, and so are strings that name a
Tessera module (what `importlib.import_module(...)` or `python -m ...` would load), so no edge hides. Also: every
import goes through the installed `tessera.` namespace (a bare `import data` would pick up any other project's
`data` package), and the pure layer and models/ never touch torch.distributed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hetero", "models", "data", "recipes", "scripts")
# lower number = lower layer; an import may only point to the same or a lower layer (the first prefix that
# matches decides). hetero/runspec (a run's config and its resolution) and what model.checkpoint is
# (checkpoint/source.py) sit above the pure plan, models and data, below everything that builds or runs.
LAYERS = [("tessera.hetero.plan", 0), ("tessera.models", 1), ("tessera.data", 2), ("tessera.hetero.runspec", 2.5),
          ("tessera.hetero.checkpoint.source", 2.5),
          ("tessera.hetero.runtime", 3), ("tessera.hetero.parallel", 3),  # process groups, boundaries, kernels
          ("tessera.hetero.optim", 3.1),                                 # gradient sync, optimizers, LR
          ("tessera.hetero.checkpoint", 3.2), ("tessera.hetero.rundir", 3.2),  # saves, resumes; the run directory
          ("tessera.hetero.build", 3.3),                                 # one rank's run, constructed
          ("tessera.hetero.export", 3.4),                                # HF / PEFT / processor files
          ("tessera.hetero.training", 3.5),                              # the loop and what runs inside it
          ("tessera.hetero.planner", 3.6), ("tessera.hetero.tools", 3.7),
          ("tessera.hetero", 3), ("tessera.recipes", 4), ("tessera.scripts", 5)]
MODULE_STRING = re.compile(r"^tessera(\.[A-Za-z_]\w*)+$")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["tessera", *parts])


def layer(module: str) -> int:
    for prefix, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return rank
    raise AssertionError(f"{module} belongs to no layer")


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import and every module-naming string constant in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            # `from tessera.models import configs` imports the module tessera.models.configs
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.match(node.value):
            out.append((node.lineno, node.value))
    return out


def tessera_modules() -> dict[str, Path]:
    return {module_name(p): p for p in source_files()}


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The Tessera module `name` refers to (a module, or the module holding an imported attribute)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def edges() -> dict[str, set[tuple[str, int]]]:
    known = tessera_modules()
    graph: dict[str, set[tuple[str, int]]] = {m: set() for m in known}
    for mod, path in known.items():
        for line, name in imports_of(path):
            if not name.startswith("tessera."):
                continue
            target = resolve(name, known)
            if target is not None and target != mod and not known[target].name == "__init__.py":
                graph[mod].add((target, line))
    return graph


def test_every_import_uses_the_tessera_namespace():
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in [*source_files(), *(ROOT / "tests").glob("*.py")]
           for line, name in imports_of(p) if name.split(".")[0] in PACKAGES]
    assert not bad, "import these as tessera.<package>:\n" + "\n".join(bad)


def test_imports_point_only_down():
    up = [f"{mod} ({layer(mod)}) -> {dst} ({layer(dst)}) at line {line}"
          for mod, targets in edges().items() for dst, line in targets if layer(dst) > layer(mod)]
    assert not up, "upward imports:\n" + "\n".join(sorted(up))


def test_no_import_cycles():
    graph = {m: {d for d, _ in ts} for m, ts in edges().items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_pure_layer_and_models_never_touch_torch_distributed():
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in source_files()
           if layer(module_name(p)) <= layer("tessera.models")
           for line, name in imports_of(p) if name.startswith("torch.distributed")]
    assert not bad, "process groups are injected; these import torch.distributed:\n" + "\n".join(bad)


def test_the_checker_sees_lazy_imports_and_module_strings(tmp_path):
    # the checker itself must see what the old tree hid: a function-level import and an importlib string
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from tessera.scripts.prepare_data import main\n\nLAUNCHER = 'tessera.hetero.tools.parity'\n")
    assert [n for _, n in imports_of(f)] == ["tessera.scripts.prepare_data", "tessera.scripts.prepare_data.main",
                                               "tessera.hetero.tools.parity"]


def test_the_planner_only_proposes_training_never_imports_it():
    # the run is resolved in the plan layer (hetero/plan/resolved_run.py); the planner proposes layouts for
    # layout=auto through the recipes. Training, runtime and parallel code never reach for the cost model.
    below = ("tessera.hetero.training", "tessera.hetero.runtime", "tessera.hetero.parallel", "tessera.hetero.build",
             "tessera.hetero.optim", "tessera.hetero.checkpoint", "tessera.hetero.export", "tessera.hetero.rundir")
    bad = [f"{mod} -> {dst} at line {line}" for mod, targets in edges().items() if mod.startswith(below)
           for dst, line in targets if dst.startswith("tessera.hetero.planner")]
    assert not bad, "the planner is above training, runtime and parallel code:\n" + "\n".join(sorted(bad))


def test_the_run_package_sits_above_plan_and_models_and_below_its_users():
    # hetero/runspec turns a config into a run (module specs, the resolved layout) once; training, the planner and
    # recipes call it, it calls none of them, and it builds no process group
    graph = edges()
    runspec = {m for m in graph if m.startswith("tessera.hetero.runspec")}
    users = ("tessera.hetero.training", "tessera.hetero.planner", "tessera.recipes")
    for prefix in users:
        assert any(d in runspec for m in graph if m.startswith(prefix) for d, _ in graph[m]), prefix
    bad = [f"{m} -> {d}" for m in runspec for d, _ in graph[m] if layer(d) >= layer("tessera.hetero")]
    bad += [f"{m}: {name}" for m in runspec for _, name in imports_of(tessera_modules()[m])
            if name.startswith("torch.distributed")]
    assert not bad, "hetero/runspec reaches up or builds process groups:\n" + "\n".join(bad)


def test_every_hetero_package_has_its_layer_and_says_what_it_owns():
    # a new folder under hetero/ is a new concern: it is placed in LAYERS (not left to the catch-all
    # `tessera.hetero`) and its __init__ docstring says what it owns and what it may import
    named = {prefix for prefix, _ in LAYERS}
    for folder in sorted(p for p in (ROOT / "hetero").iterdir() if p.is_dir() and p.name != "__pycache__"):
        pkg = f"tessera.hetero.{folder.name}"
        assert pkg in named, f"{pkg} has no layer in tests/test_layering.py LAYERS"
        init = folder / "__init__.py"
        assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), f"{init} says nothing"


def test_the_readme_walks_follow_the_imports():
    # the README's code map walks `model.checkpoint` and `model.vision` from the command line to the work: each
    # file on a walk must reach the next through its imports (a moved or renamed file breaks the walk here, not
    # in a newcomer's afternoon), a walk has at most 8 files and never returns to one; the side files named in
    # parentheses must exist
    text = (ROOT / "README.md").read_text()
    block = text[text.index("**Two walks**"):]
    block = block[block.index("\n\n") + 2:]  # the list after the walks' introduction
    walks = re.split(r"^- ", block[:block.index("\n\n")], flags=re.M)[1:]
    assert len(walks) == 2, "the README's code map has its two walks"
    graph = {m: {d for d, _ in ts} for m, ts in edges().items()}

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            m = todo.pop()
            if m == b:
                return True
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        return False

    for walk in walks:
        flat = " ".join(walk.split())
        depth, main = 0, ""
        for ch in flat:  # the walk itself: what is outside parentheses
            depth += ch == "("
            main += ch if depth == 0 else ""
            depth -= ch == ")"
        files = re.findall(r"`([\w/]+\.py)`", main)
        side = set(re.findall(r"`([\w/]+\.py)`", flat)) - set(files)
        assert 2 <= len(files) <= 8 and len(set(files)) == len(files), (flat[:60], files)
        mods = ["tessera." + f[:-3].replace("/", ".") for f in files]
        for a, b in zip(mods, mods[1:]):
            assert reaches(a, b), f"README walk: {a} does not reach {b} through its imports"
        for f in side:
            assert (ROOT / f).is_file() or (ROOT / "models" / "encoder_families" / f).is_file(), f


def test_no_private_name_is_imported_across_files():
    # a name with a leading underscore is its file's own: another file that needs it asks for a public one
    bad = []
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tessera."):
                bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "private names imported from another file:\n" + "\n".join(bad)
