import json
import os
import random
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-fast-path", choices=("auto", "off"), default="auto",
        help="off: every config a test builds in this process runs with train.cpu_fast_path=off (plain transformers "
             "and autograd) unless it names a part of the fast path itself; tests of the fast path skip. "
             "`make test` runs tests/trainers/ once more this way.",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--cpu-fast-path") == "off":
        skip = pytest.mark.skip(reason="a test of the CPU fast path itself (--cpu-fast-path=off)")
        once = pytest.mark.skip(reason="what it tests does not run through the step's CPU path (--cpu-fast-path=off)")
        for item in items:
            if item.get_closest_marker("fast_path"):
                item.add_marker(skip)
            elif item.get_closest_marker("one_path"):
                item.add_marker(once)


@pytest.fixture(scope="session", autouse=True)
def cpu_fast_path_pass(request) -> str:
    """``auto`` or ``off``: the pass this session runs. Under ``off``, every config built in this process and in
    the processes its tests start runs on the plain path (``tests/plain_path/sitecustomize.py`` says how), for
    the whole session, so session- and module-scoped fixtures build theirs on it too."""
    setting = request.config.getoption("--cpu-fast-path")
    if setting != "off":
        yield setting
        return
    from cohortrl.config import Config
    from tests.plain_path.sitecustomize import plain

    folder = str(REPO / "tests" / "plain_path")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Config, "__post_init__", plain(Config.__post_init__))
        patch.setenv("PYTHONPATH", os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p))
        yield setting


@pytest.fixture(scope="session")
def addition_jsonl(tmp_path_factory) -> Path:
    """300 single-digit additions as a JSONL file with prompt/answer columns."""
    path = tmp_path_factory.mktemp("data") / "add.jsonl"
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(300):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    return path
