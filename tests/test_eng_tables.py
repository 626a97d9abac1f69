"""The tables of docs/engineering.md that scripts/eng_tables.py marks are what it makes of the committed sweep
folders now, byte for byte; and the comparison catches a changed number."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location("eng_tables", REPO / "scripts" / "eng_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["eng_tables"] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    yield module
    del sys.modules["eng_tables"]
    sys.path.remove(str(REPO / "scripts"))


@pytest.fixture(scope="module")
def made(script):
    """Every table made once from the committed folders (the slow part, seconds a table), keyed by the table."""
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return {id(table): script.render(table) for table in script.TABLES.values()}
    finally:
        os.chdir(cwd)


def test_every_marked_table_regenerates_from_the_committed_folders(script, made, monkeypatch):
    monkeypatch.setattr(script, "render", lambda table: made[id(table)])
    text = script.DOC.read_text()
    new, names = script.regenerate(text)
    assert sorted(names) == sorted(script.TABLES), "a table is defined but not marked, or marked twice"
    assert new == text, "a marked table of docs/engineering.md differs from scripts/eng_tables.py's output"


def test_a_changed_number_is_put_back(script, made, monkeypatch):
    monkeypatch.setattr(script, "render", lambda table: made[id(table)])
    text = script.DOC.read_text()
    assert "| 0.972, 0.008 |" in text
    tampered = text.replace("| 0.972, 0.008 |", "| 0.973, 0.008 |", 1)
    assert script.regenerate(tampered)[0] == text


def test_an_unknown_marker_is_refused(script):
    with pytest.raises(SystemExit, match="does not define"):
        script.regenerate("<!-- table no_such_table: scripts/eng_tables.py -->\n| a |\n")


def test_a_marker_must_sit_right_above_its_table(script):
    name = next(iter(script.TABLES))
    with pytest.raises(SystemExit, match="must start on the line right after its marker"):
        script.regenerate(f"<!-- table {name}: scripts/eng_tables.py -->\n\n| a |\n")
