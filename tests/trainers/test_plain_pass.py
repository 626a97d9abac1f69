"""The CPU path a session runs (``pytest --cpu-fast-path=off``, tests/conftest.py, or not) reaches every config a
test builds, in the test's process and in the processes it starts, so a resume in a subprocess agrees with the run
it resumes."""

import subprocess
import sys

from cohortrl.config import Config

PRINT_THE_PATH = "from cohortrl.config import Config; print(Config().train.cpu_fast_path)"


def test_the_pass_reaches_every_config_here_and_in_a_subprocess(cpu_fast_path_pass):
    assert Config().train.cpu_fast_path == cpu_fast_path_pass
    # a config that names a part of the fast path is a test of the fast path: it keeps it on either pass
    assert Config(train={"cpu_linear": "onednn"}).train.cpu_fast_path == "auto"
    started = subprocess.run([sys.executable, "-c", PRINT_THE_PATH], capture_output=True, text=True, check=True)
    assert started.stdout.strip() == cpu_fast_path_pass
