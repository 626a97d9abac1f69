"""The plain-path pass (``pytest --cpu-fast-path=off``, tests/conftest.py): every ``Config`` built gets
``train.cpu_fast_path = off`` after its checks, unless its ``train.cpu_linear`` or ``train.cpu_allocator`` asks
for a part of the fast path by name (such a test is about the fast path and keeps it).

tests/conftest.py applies `plain` to the test process; for the processes a test starts (the command line in a
subprocess, torchrun's ranks) it puts this folder first on ``PYTHONPATH``, where Python's start-up imports this
file as ``sitecustomize`` and applies it there too."""


def plain(post_init):
    """``Config.__post_init__`` followed by the switch to the plain path."""

    def on_the_plain_path(cfg) -> None:
        post_init(cfg)  # converted and checked as given; off allows all that auto does but these two names
        t = cfg.train
        if t.cpu_linear in ("auto", "aten") and t.cpu_allocator in ("auto", "system"):
            t.cpu_fast_path = "off"

    return on_the_plain_path


if __name__ == "sitecustomize":  # imported by Python's start-up, not by tests/conftest.py
    try:
        from cohortrl.config import Config
    except ImportError:  # a process without cohortrl (another venv's Python): nothing to switch
        pass
    else:
        Config.__post_init__ = plain(Config.__post_init__)
