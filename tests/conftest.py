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


@pytest.fixture(autouse=True)
def plain_path_pass(request, monkeypatch):
    """Under ``--cpu-fast-path=off``: each ``Config`` built gets ``train.cpu_fast_path = off`` after its checks,
    unless its ``train.cpu_linear`` or ``train.cpu_allocator`` asks for a part of the fast path by name (such a
    test is about the fast path and keeps it). Configs built in a subprocess are not reached."""
    if request.config.getoption("--cpu-fast-path") != "off":
        return
    if request.node.get_closest_marker("fast_path"):
        pytest.skip("a test of the CPU fast path (--cpu-fast-path=off)")
    from cohortrl.config import Config

    post_init = Config.__post_init__

    def on_the_plain_path(cfg):
        post_init(cfg)  # converted and checked as given; off allows all that auto does but these two names
        t = cfg.train
        if t.cpu_linear in ("auto", "aten") and t.cpu_allocator in ("auto", "system"):
            t.cpu_fast_path = "off"

    monkeypatch.setattr(Config, "__post_init__", on_the_plain_path)


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
