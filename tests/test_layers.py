"""The layer rule of docs/architecture.md, read from the source: every ``import`` of every module (lazy imports
inside functions count), mapped to the top-level package or module it lands in.

    cli -> (sweep, study) -> trainers -> (rewards, reward_models, rollout) -> (tasks, tools, data, models, ...)
        -> (grading, algorithms, config, step_spans, ...)

A module may import its own layer or any lower one, never a higher one, and the imports between top-level
units must not form a cycle (checked even within a layer, where the rule alone would allow one); nor may the
imports between the modules of one package (``tools/base.py`` -> ``tools/calculator.py`` -> ``tools/base.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cohortrl"

# Highest layer first. The root package (``cohortrl/__init__.py``: the lazy public API) stands above everything.
LAYERS = [
    {"__init__"},
    {"__main__", "cli"},
    {"sweep", "study", "demo"},
    {"trainers"},
    {"rewards", "rollout", "reward_models"},
    {"tasks", "tools", "data", "models", "planner", "distributed", "cpu"},
    {"grading", "algorithms", "config", "trl_names", "trl_config", "user_code", "stats", "machine", "step_spans"},
]
RANK = {unit: len(LAYERS) - i for i, layer in enumerate(LAYERS) for unit in layer}


def module_name(path: Path) -> str:
    """``cohortrl/rewards/functions.py`` -> ``cohortrl.rewards.functions``; a package's ``__init__.py`` -> the package."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


MODULES = {module_name(path) for path in PACKAGE.rglob("*.py")}
PACKAGES = sorted(module_name(path) for path in PACKAGE.rglob("__init__.py"))


def unit_of(module: str) -> str:
    """``cohortrl.rewards.functions`` -> ``rewards``; ``cohortrl`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_of(target: str) -> str:
    """The module an imported name lives in: ``cohortrl.tools.base.ToolError`` -> ``cohortrl.tools.base``."""
    while target not in MODULES:
        target = target.rpartition(".")[0]
    return target


def module_imports() -> list[tuple[str, str, str]]:
    """(importing module, imported module, "path:line") for every import of a cohortrl module in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # "from cohortrl import tasks" imports the module named after "import"; "from m import f", m
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] != "cohortrl" or target == "cohortrl.__version__":
                    continue  # __version__: a constant of the root package, no import of the API behind it
                found.append((module, module_of(target), f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"))
    return found


def imports() -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, "path:line") for every cross-unit import in the package."""
    return [(unit_of(src), unit_of(dst), at) for src, dst, at in module_imports() if unit_of(src) != unit_of(dst)]


def test_every_unit_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file())}
    missing = sorted(units - set(RANK))
    assert not missing, f"{missing} have no layer: add each to LAYERS here and to docs/architecture.md"


def test_no_import_goes_up_a_layer():
    upward = [f"{where}: {src} imports {dst}" for src, dst, where in imports() if RANK[dst] > RANK[src]]
    assert not upward, "imports against the layer rule (docs/architecture.md):\n" + "\n".join(upward)


# Where the CPU fast path's object is built (cohortrl/cpu/__init__.py): the package's only importers outside it,
# each behind the `cpu_fast_path: off` check, so a plain run never imports it (tests/trainers/test_plain_path_imports.py).
CPU_FAST_PATH_BUILDERS = {"cohortrl.trainers.setup", "cohortrl.reward_models.train"}


def test_the_cpu_fast_path_is_imported_only_where_its_object_is_built():
    others = [f"{where}: {src} imports {dst}" for src, dst, where in imports()
              if dst == "cpu" and src != "cpu" and module_of_path(where) not in CPU_FAST_PATH_BUILDERS]
    assert not others, ("cohortrl/cpu/ is handed in as one object (cpu.FastPath), built in "
                        f"{sorted(CPU_FAST_PATH_BUILDERS)} only; pass it instead of importing:\n" + "\n".join(others))


def module_of_path(where: str) -> str:
    """``cohortrl/trainers/setup.py:12`` -> ``cohortrl.trainers.setup``."""
    return where.rpartition(":")[0].removesuffix(".py").replace("/", ".")


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, stack)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_top_level_units():
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for src, dst, at in imports():
        if src == "__init__":
            continue  # the root's lazy API table points down at everything; nothing below imports the root
        edges.setdefault(src, set()).add(dst)
        where.setdefault((src, dst), at)
    cycle = find_cycle(edges)
    if cycle:
        steps = [f"{a} -> {b} ({where[a, b]})" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle between top-level units:\n" + "\n".join(steps))


def child_of(package: str, module: str) -> str | None:
    """The module or sub-package of ``package`` that ``module`` is or lies in (``__init__`` for the package
    itself); None outside it. ``cohortrl.tasks.st.interpreter`` in ``cohortrl.tasks`` -> ``st``."""
    if module == package:
        return "__init__"
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1:].split(".")[0]


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "cohortrl"])  # the root: the test above
def test_no_import_cycle_inside_a_package(package):
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for src, dst, at in module_imports():
        a, b = child_of(package, src), child_of(package, dst)
        if a is not None and b is not None and a != b:
            edges.setdefault(a, set()).add(b)
            where.setdefault((a, b), at)
    cycle = find_cycle(edges)
    if cycle:
        steps = [f"{a} -> {b} ({where[a, b]})" for a, b in zip(cycle, cycle[1:])]
        pytest.fail(f"import cycle inside {package}: move what the modules share into a module both import\n"
                    + "\n".join(steps))


MAX_MODULE_LINES = 800  # docs/architecture.md, STYLE.md habit 7: what one person holds in their head


def test_no_module_is_longer_than_one_person_holds_in_their_head():
    long = [f"{path.relative_to(PACKAGE.parent)}: {n} lines" for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them where the code shows a seam):\n" + "\n".join(long)
