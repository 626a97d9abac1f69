"""cohortrl/tools sits low in the layers: rollout, rewards and trainers import it, never the reverse, and only
the simulate tool reads the gym (tasks)."""

import ast
from pathlib import Path

import cohortrl.tools

PACKAGE = Path(cohortrl.tools.__file__).parent
HIGHER = ("cohortrl.rollout", "cohortrl.rewards", "cohortrl.trainers", "cohortrl.cli", "cohortrl.reward_models")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:  # "from cohortrl import tasks" names cohortrl.tasks
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_tools_import_nothing_above_them_and_only_simulate_reads_the_gym():
    files = sorted(PACKAGE.glob("*.py"))
    assert {f.name for f in files} >= {"base.py", "calculator.py", "simulate.py", "text.py"}
    for path in files:
        modules = imported_modules(path)
        assert not [m for m in modules if m.startswith(HIGHER)], path.name
        uses_tasks = any(m == "cohortrl.tasks" or m.startswith("cohortrl.tasks.") for m in modules)
        assert uses_tasks == (path.name == "simulate.py"), path.name
