"""The sandbox server survives anything a job does (issue 27), and a crash of the server costs an honest job
in flight nothing: it runs again once on a new server.

Each finding of the issue is reproduced: a job writing deeply nested JSON as its result (``json.loads``
raised RecursionError and the server died), a job dying of a real-time signal provoked with
``F_SETOWN``/``F_SETSIG``/``O_ASYNC`` on its own stdout (the reason lookup raised for signal 40), forged
results with calls that are not objects or values nested a thousand deep. Hostile jobs reach the real ``os``
module the way an escape from restricted builtins does (tests/rewards/test_sandbox.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from cohortrl import tasks
from cohortrl.grading import sandbox as sandbox_module
from cohortrl.grading.sandbox import Job, Sandbox
from cohortrl.grading.sandbox_server import as_json, check_result, signal_name

LIMIT = 1.0
ESCAPE = ("_os = next(c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close')"
          ".__init__.__globals__\n")
HONEST = "def f(x):\n    return 2 * x\n"


def forge(result_bytes: str) -> str:
    """A job that writes ``result_bytes`` (a Python expression for bytes) as its own result and exits."""
    return ESCAPE + f"def f(*args):\n    _os['write'](3, {result_bytes})\n    _os['_exit'](0)\n"


# F_SETOWN (8) to itself, F_SETSIG (10) to signal 40, O_ASYNC on its stdout: when the server reads what
# it printed, the kernel sends it signal 40, whose default action ends the process.
REALTIME_SIGNAL = ESCAPE + """
def f(*args):
    libc = _os['sys'].modules['ctypes'].CDLL(None)
    results = [libc.fcntl(1, 8, _os['getpid']()), libc.fcntl(1, 10, 40)]
    results.append(libc.fcntl(1, 4, libc.fcntl(1, 3) | 0o20000))
    _os['write'](1, b'x' * 60000)
    _os['sys'].modules['time'].sleep(0.5)
    return results
"""

HOSTILE = {
    "deeply nested JSON result": forge("b'[' * 100000"),
    "forged calls that are not objects": forge("b'{\"calls\": [1], \"seccomp\": true}'"),
    "forged value nested 1000 deep": forge("(('{\"calls\": [{\"ok\": true, \"value\": ' + '[' * 1000 + ']' * 1000 + '}]}')).encode()"),
    "forged integer of 400 digits": forge("(('{\"calls\": [{\"ok\": true, \"value\": 1' + '0' * 400 + '}]}')).encode()"),
    "forged error that is not text": forge("b'{\"error\": [1, 2]}'"),
    "invalid UTF-8 and lone surrogates": forge("b'{\"calls\": [{\"ok\": true, \"value\": \"\\\\ud800\"}]}\\xff'"),
    "a real-time signal through F_SETOWN/F_SETSIG": REALTIME_SIGNAL,
}


@pytest.fixture(scope="module")
def box():
    sandbox = Sandbox().start()
    yield sandbox
    sandbox.close()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_server_survives_each_finding_and_honest_jobs_beside_it_succeed(box, name):
    pid = box.server_pid
    jobs = [Job(HONEST, "f", [[1]], LIMIT), Job(HOSTILE[name], "f", [[]], LIMIT), Job(HONEST, "f", [[2]], LIMIT)]
    first, hostile, last = box.run_many(jobs)
    assert first.ok and first.calls[0].value == 2 and last.ok and last.calls[0].value == 4
    assert box.server_pid == pid, f"{name}: the server was replaced"
    if name.startswith("a real-time"):  # seccomp refuses F_SETOWN and F_SETSIG: nothing happens to anyone
        assert hostile.ok and hostile.calls[0].value[:2] == [-1, -1], hostile
    else:
        assert not hostile.ok and "the job's result was malformed" in hostile.reason, hostile.reason
        assert "exited" not in hostile.reason


def test_a_job_that_dies_of_a_realtime_signal_is_named_and_the_server_survives():
    # Without seccomp (a machine without it), the job can provoke signal 40; the server used to die
    # building signal.Signals(40) for the reason.
    weak = Sandbox(seccomp=False).start()
    try:
        pid = weak.server_pid
        died, honest = weak.run_many([Job(REALTIME_SIGNAL, "f", [[]], 2.0), Job(HONEST, "f", [[3]], LIMIT)])
        assert not died.ok and died.reason.startswith("killed by signal SIGRTMIN+"), died.reason
        assert honest.ok and honest.calls[0].value == 6 and weak.server_pid == pid
    finally:
        weak.close()


def test_signal_names_for_any_number():
    assert signal_name(9) == "SIGKILL"
    assert signal_name(40).startswith("SIGRTMIN+")
    assert signal_name(200) == "signal 200"


@pytest.mark.parametrize("raw, why", [
    (b"[" * 100000, "not valid JSON (RecursionError)"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"calls": [1]}', "call 1 is not an object with a boolean 'ok'"),
    (b'{"calls": [{"ok": 1, "value": 2}]}', "call 1 is not an object with a boolean 'ok'"),
    (b'{"calls": [{"ok": true}, {"ok": true}]}', "one entry per call (1)"),
    (b'{"calls": [{"ok": true, "value": ' + b"[" * 25 + b"]" * 25 + b"}]}", "nested at most 20 deep"),
    (b'{"calls": [{"ok": true, "value": 1' + b"0" * 301 + b"}]}", "not plain data"),
    (b'{"calls": [{"ok": false, "error": {"a": 1}}]}', "call 1 has no error text"),
    (b'{"error": 5}', "error is not text"),
])
def test_a_childs_result_is_checked_without_raising(raw, why):
    data, reason = check_result(raw, 1)
    assert data is None and why in reason


def test_a_well_formed_result_passes_with_long_error_texts_cut():
    data, reason = check_result(b'{"calls": [{"ok": true, "value": [1.5, "a", {"k": null}]}], "seccomp": true}', 1)
    assert reason == "" and data == {"calls": [{"ok": True, "value": [1.5, "a", {"k": None}]}], "seccomp": True}
    data, _ = check_result(b'{"error": "' + b"x" * 5000 + b'"}', 1)
    assert len(data["error"]) < 1300


def test_returned_subclasses_become_plain_values_read_through_the_base_type():
    class Sneaky(int):  # the int: passes the size guard through __abs__, then overflows a float
        def __abs__(self):
            return 0

    class Shouty(str):
        def __eq__(self, other):
            return True

        __hash__ = str.__hash__

    class Liar(list):
        def __iter__(self):
            return iter([99])

    with pytest.raises(TypeError, match="integer too large"):
        as_json(Sneaky(10**400))
    for value, plain in ((Sneaky(7), 7), (Shouty("SAFE"), "SAFE"), (Liar([1, 2]), [1, 2]), ((1, Sneaky(2)), [1, 2])):
        converted = as_json(value)
        assert converted == plain and type(converted) is type(plain)
    assert type(as_json([Sneaky(1)])[0]) is int and type(as_json({"k": Shouty("v")})["k"]) is str


def test_a_malformed_reply_is_a_failed_job_not_an_exception():
    for reply in ({"ok": True, "calls": [1]}, {"ok": True, "calls": [{"ok": True, "value": object()}]},
                  {"ok": True, "reason": ["x"]}, {"ok": True, "seconds": {"x": 1}}):
        result = sandbox_module._job_result(reply)
        assert not result.ok and "reply was malformed" in result.reason


def test_an_honest_job_in_flight_when_the_server_crashes_runs_again_once(caplog):
    sandbox = Sandbox().start()
    try:
        pid = sandbox.server_pid
        results = []
        slow = "import time\ndef f(x):\n    time.sleep(0.6)\n    return x + 1\n"
        worker = threading.Thread(target=lambda: results.append(sandbox.run(slow, "f", [[41]], timeout_s=3.0)))
        worker.start()
        time.sleep(0.3)
        os.kill(pid, 9)  # a crash of the server this test started, with the job in flight
        worker.join(timeout=15)
        assert results and results[0].ok and results[0].calls[0].value == 42, results
        assert sandbox.server_pid not in (None, pid)
        said = [r.getMessage() for r in caplog.records if r.name == "cohortrl.grading.sandbox"]
        assert said == ["sandbox: the sandbox server exited (code -9) with a job in flight; running it again on a new server"]
    finally:
        sandbox.close()


# ---------------------------------------------------------------------------------------------------------
# The same, through the public grade API: a hostile response graded at the same moment as a correct one.

FAMILY = tasks.get("python_function", timeout_s=LIMIT)


def axial_sample():
    return next(s for s in FAMILY.sample(20, seed=0, level=1) if s.extra["function"] == "axial_stress")


@pytest.mark.parametrize("name", ["deeply nested JSON result", "a real-time signal through F_SETOWN/F_SETSIG"])
def test_a_correct_answer_graded_beside_a_server_killer_scores_full_marks(name):
    sample = axial_sample()
    hostile = "```python\n" + HOSTILE[name].replace("def f(", "def axial_stress(") + "```"
    pid = sandbox_module.shared().server_pid
    grades = {}
    threads = [threading.Thread(target=lambda k=k, c=c: grades.__setitem__(k, FAMILY.grade(sample, c)))
               for k, c in (("hostile", hostile), ("honest", sample.reference_solution))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert grades["honest"].outcome == 1.0 and grades["hostile"].outcome == 0.0
    assert sandbox_module.shared().server_pid == pid
