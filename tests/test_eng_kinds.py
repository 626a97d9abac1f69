"""The committed by-kind tables (docs/**/*_kinds.md, scripts/eng_kinds.py) are what the script makes of the
committed answers now, byte for byte."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def kinds_tables() -> list[Path]:
    return sorted((REPO / "docs").rglob("*_kinds.md"))


def load_script():
    spec = importlib.util.spec_from_file_location("eng_kinds", REPO / "scripts" / "eng_kinds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_is_a_committed_table_to_check():
    assert kinds_tables(), "docs/engineering/r2_cos250_kinds.md went missing"


@pytest.mark.parametrize("md", kinds_tables(), ids=lambda p: p.name)
def test_each_committed_kinds_table_regenerates_from_its_committed_answers(md, monkeypatch):
    command = md.read_text().split("Regenerate: `")[1].split("`")[0]
    args = shlex.split(command)[1:]
    out = args[args.index("--out") + 1]
    folders = args[: args.index("--out")]
    assert out == str(md.relative_to(REPO)), f"{md}: its Regenerate line writes {out}"
    for folder in folders:
        assert (REPO / folder / "sweep.json").is_file(), f"{md}: {folder} is not a committed sweep folder"
    monkeypatch.chdir(REPO)  # the folders are named relative to the checkout, as in the doc
    assert load_script().document(folders, out) == md.read_text()
