"""Smoke test of `tasks list | sample | grade` in a subprocess, as a user would run them."""

import json
import subprocess
import sys

import pytest

from cohortrl import tasks


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "cohortrl.tasks.cli", "tasks", *args], capture_output=True,
                          text=True, timeout=60, cwd=cwd)


def test_list_sample_grade(tmp_path):
    listed = run("list")
    assert listed.returncode == 0 and all(name in listed.stdout for name in tasks.names())

    shown = run("sample", "axial_stress", "--level", "2", "--n", "2", "--seed", "3")
    assert shown.returncode == 0 and shown.stdout.count("--- reference solution") == 2

    rows = [json.loads(line) for line in run("sample", "arithmetic", "--level", "2", "--n", "3", "--json").stdout.splitlines()]
    responses = tmp_path / "responses.jsonl"
    lines = [{"seed": 0, "index": 0, "completion": rows[0]["reference_solution"]},
             {"seed": 0, "index": 1, "completion": "ANSWER: -1"},
             {"sample": rows[2], "completion": rows[2]["reference_solution"]}]
    responses.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    graded = run("grade", "arithmetic", "--level", "2", "--file", str(responses))
    assert graded.returncode == 0, graded.stderr
    results = [json.loads(line) for line in graded.stdout.splitlines()]
    assert [r["outcome"] for r in results] == [1.0, 0.0, 1.0]
    assert results[0]["id"] == rows[0]["id"] and "mean outcome 0.667" in graded.stderr


@pytest.mark.parametrize("command", [[], ["list"], ["sample"], ["grade"]])
def test_every_subcommand_has_help(command):
    helped = run(*command, "--help")
    assert helped.returncode == 0 and "usage:" in helped.stdout
