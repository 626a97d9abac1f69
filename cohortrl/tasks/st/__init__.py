"""A Structured Text (IEC 61131-3) subset: grammar (`syntax`) and interpreter (`interpreter`).

    from cohortrl.tasks.st import Var, compile_program
    program = compile_program(text, [Var("level", "REAL", input=True), Var("pump", "REAL", input=False)])
    program.reset()
    pump, = program.scan([0.42], now=0.0)

Errors (`STError`) carry a message meant for the model: where, and what is outside the subset.
"""

from cohortrl.tasks.st.interpreter import Program, STRuntimeError, Var, compile_program
from cohortrl.tasks.st.syntax import STError

__all__ = ["Program", "STError", "STRuntimeError", "Var", "compile_program"]
