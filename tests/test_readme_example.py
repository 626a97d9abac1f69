"""The README's Python example runs as written; only the model is swapped for the tiny one (SmolLM2 would take
minutes here), in an empty working directory."""

import re
from pathlib import Path

from cohortrl.trainers.metrics import read_metrics

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert blocks, "the README has no Python example"
    code = blocks[0]
    assert code.count('"smollm2-135m-instruct"') == 1
    monkeypatch.chdir(tmp_path)
    exec(compile(code.replace('"smollm2-135m-instruct"', '"tiny-llama"'), "README.md", "exec"), {"__name__": "__main__"})
    rows = read_metrics(tmp_path / "runs" / "mine")
    assert [r["step"] for r in rows] == list(range(1, 26))  # 25 steps, no held-out evaluation: the rows are all trained on
    assert (tmp_path / "runs" / "mine" / "final").is_dir()
