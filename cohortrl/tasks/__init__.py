"""The engineering gym: procedurally generated problems with deterministic outcome and step graders.

    from cohortrl import tasks
    family = tasks.get("axial_stress")          # tasks.names() lists every family
    samples = family.sample(8, seed=0, level=1)
    grade = family.grade(samples[0], completion)  # grade.outcome, grade.steps, grade.score

Every family shares one answer format (`cohortrl.grading.answer_format`), one tolerance-and-units rule
(`cohortrl.grading.units`) and one
step grader with the anti-hacking rules (`base.grade_keyed`). Two code families answer with programs instead:
``controller`` (Structured Text, graded by simulating plants) and ``python_function`` (Python, graded by
hidden tests run in `cohortrl.grading.sandbox`). See docs/tasks.md and docs/sandbox.md.
"""

from cohortrl.tasks import (  # noqa: F401  (importing registers the families)
    arithmetic,
    axial_stress,
    beam_bending,
    controller,
    gsm8k,
    python_function,
    truss,
)
from cohortrl.tasks.base import Grade, Sample, Step, StepResult, TaskFamily, get, names, register, sample_from_id

__all__ = ["Grade", "Sample", "Step", "StepResult", "TaskFamily", "get", "names", "register", "sample_from_id"]
