"""The two CPU paths a trainer test can run on (``cpu_path``): "fast", ``train.cpu_fast_path=auto`` (on a CPU
build with oneDNN: oneDNN linear products, the lean decoder, the update reusing decoding's forward where the
config allows it), and "plain", ``train.cpu_fast_path=off`` (plain transformers and autograd throughout).
``pytest --cpu-fast-path=off`` (tests/conftest.py) runs every trainer test on the plain path; there the "fast"
case skips. ``one_thread``: for tests that compare whole runs."""

import pytest
import torch

from cohortrl.cpu import kernels
from cohortrl.cpu import decoder


class CPUPath:
    """Sets nothing itself: a test passes ``train=cpu_path.train`` settings to its trainers, then calls
    :meth:`check`, which asserts that they really ran this path (counted by spies on oneDNN's linear op and on
    the lean decoder, over the whole test)."""

    def __init__(self, name: str, monkeypatch):
        self.name = name
        self.train = {"fast": {"cpu_fast_path": "auto"}, "plain": {"cpu_fast_path": "off"}}[name]
        self.onednn_products, self.decoders = [], []
        onednn, init = kernels._onednn, decoder.LlamaDecoder.__init__
        monkeypatch.setattr(kernels, "_onednn", lambda *a: self.onednn_products.append(1) or onednn(*a))

        def counted_init(dec, *a, **kw):
            self.decoders.append(1)
            init(dec, *a, **kw)

        monkeypatch.setattr(decoder.LlamaDecoder, "__init__", counted_init)

    def check(self, trainer, rows=(), *, decodes: bool = True, replays: bool = False) -> None:
        """``trainer`` (the test's last) ran this path, and so did the test's ``rows`` (logged training steps).
        ``decodes``: the test generated (a rollout or an evaluation), so the fast path built the lean decoder;
        ``replays``: the test's config lets an update reuse decoding's forward, so the fast path did. The plain
        path (and the fast one on a build without oneDNN, where it is the plain path) did none of it."""
        fast = self.name == "fast" and kernels.onednn_available()
        fast_path = trainer.fast_path
        lean = fast_path is not None and fast_path.decoder_for(trainer.model) is not None
        replayed = sum(r.get("rollout_forward_reused") or 0 for r in rows)
        assert (fast_path.linear if fast_path is not None else "aten") == ("onednn" if fast else "aten")
        if self.name == "plain":
            assert fast_path is None  # off: no fast path object at all, so nothing of cpu/ runs
        assert lean == fast
        assert bool(self.onednn_products) == fast
        assert bool(self.decoders) == (fast and decodes)
        assert bool(replayed) == (fast and replays), replayed


@pytest.fixture(params=["fast", "plain"])
def cpu_path(request, monkeypatch) -> CPUPath:
    if request.param == "fast" and request.config.getoption("--cpu-fast-path") == "off":
        pytest.skip("the fast path's case (--cpu-fast-path=off)")
    return CPUPath(request.param, monkeypatch)


@pytest.fixture
def one_thread(monkeypatch):
    """As the golden runs (``tests/golden/runs.py`` THREADS): one thread, the same numbers as two in a fraction of
    the time on a busy 2-core machine; and no end-of-run plot, which nothing reads and matplotlib makes slow."""
    monkeypatch.setattr("cohortrl.trainers.loop.plot_curves", lambda run_dir: None)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
