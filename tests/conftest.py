import json
import os
import random
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

REPO = Path(__file__).resolve().parent.parent


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
