"""``scripts/step_lines.py``: the RL step's own file is under 300 lines, counted whole, and a GRPO step runs through
its ``rl_step`` (issue 54)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_step_is_one_file_under_300_lines_that_a_grpo_step_runs_through():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "step_lines.py")], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    n = int(out.stdout.split("RL step, lines to read: ")[1].split()[0])
    assert n == len((REPO / "cohortrl" / "trainers" / "step.py").read_text().splitlines()) and n < 300
