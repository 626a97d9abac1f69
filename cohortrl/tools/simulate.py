"""The built-in ``simulate`` tool for the controller family: run the model's Structured Text program against the
scenario shown in the prompt and say how it did, as an engineer would try a controller before handing it in.

Only the shown (``visible``) scenarios are simulated; the hidden ones, which the grade also runs, are never
touched, so their setpoints, event times and plant variations cannot leak through the feedback. The program
is interpreted by the gym's own Structured Text interpreter (``cohortrl.tasks.st``: no loops, a bounded
number of operations per scan), the same code the controller grader runs in the trainer's process; no
model-written Python is executed.
"""

from __future__ import annotations

import dataclasses

from cohortrl import tasks
from cohortrl.tasks.controller import STAGES
from cohortrl.tools.errors import ToolError

_MAX_MISSES = 3  # performance misses listed in the feedback; more only lengthen the result


def simulate(program: str, row: dict) -> str:
    """Run a Structured Text controller program against the scenario shown in the problem and report which
    stages it passes (parse, run, safety, performance) and why the first failing one fails.

    Args:
        program: the whole program (VAR ... END_VAR declarations and the statements), with or without a ```st fence
        row: the dataset row of the problem being answered (filled in by the trainer, not by the model)
    """
    family, sample = _controller_sample(row)
    shown = [s for s in sample.extra["scenarios"] if s["name"].startswith("visible")]
    sample = dataclasses.replace(sample, extra={**sample.extra, "scenarios": shown})
    text = program if "```" in program else f"```st\n{program}\n```"
    report = family.evaluate(sample, text)
    if len(report.passed) == len(STAGES):
        return "passes parse, run, safety and performance on the shown scenario (the hidden ones are not run here)"
    failing = STAGES[len(report.passed)]
    passed = f"passes {', '.join(report.passed)}; " if report.passed else ""
    misses = "; ".join(report.failures[1:_MAX_MISSES])
    return f"{passed}fails {failing}: {report.reason}" + (f"; also {misses}" if misses else "")


def _controller_sample(row: dict | None):
    data = (row or {}).get("sample")
    if not isinstance(data, dict) or data.get("family") != "controller":
        raise ToolError("simulate works only on controller problems (rows from data.source: task:controller)")
    family = tasks.get("controller")
    return family, family.sample_from_dict(data)
