"""``train.cpu_allocator`` (cohortrl/cpu/memory.py): freed memory stays mapped in the process under glibc."""

import subprocess
import sys
import textwrap

import pytest

from cohortrl.cpu import memory as cpu_memory
from cohortrl.config import Config, ConfigError
from cohortrl.cpu.memory import resolve_cpu_allocator

glibc_only = pytest.mark.skipif(cpu_memory._glibc() is None, reason="mallopt is glibc's")

# Eight blocks of the given MiB, written and freed in reverse (a step's buffers), four times over; the minor
# page faults of each round. Straight from libc's malloc, so nothing else allocates in between. Each fresh 4 KiB
# page faults once at its first write. glibc's defaults map the first round and trim the heap's freed top (or
# unmap blocks above the mmap threshold) after every later one, so every round faults its pages in again;
# retained, only the first does.
_PROBE = textwrap.dedent("""
    import ctypes, resource, sys
    from cohortrl.cpu.memory import release_freed_memory, retain_freed_memory
    if sys.argv[1] in ("retain", "released"):
        assert retain_freed_memory()
    if sys.argv[1] == "released":  # a run that retained, then closed
        release_freed_memory()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    size, faults = int(sys.argv[2]) * 1024 * 1024, []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(size) for _ in range(8)]
        for b in blocks:
            ctypes.memset(b, 1, size)
        for b in reversed(blocks):
            libc.free(b)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(*faults)
""")


def _faults(mode: str, mib: int) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode, str(mib)], capture_output=True, text=True, check=True)
    return [int(n) for n in out.stdout.split()]


@glibc_only
@pytest.mark.parametrize("mib", [16, 48])  # below and above glibc's largest mmap threshold (32 MiB)
def test_freed_blocks_stay_resident_for_the_next_round(mib):
    pages = 8 * mib * 1024 * 1024 // 4096  # one round's fresh pages
    system, retained = _faults("system", mib), _faults("retain", mib)
    assert all(n > pages * 0.9 for n in system)  # glibc's defaults: every round faults in again
    assert retained[0] > pages * 0.9  # the first touch is paid once either way
    assert all(n < pages * 0.01 for n in retained[1:])  # then the heap's freed blocks are reused as they are
    released = _faults("released", mib)
    assert all(n > pages * 0.9 for n in released)  # glibc's defaults are back: the setting did not outlive the run


class _FakeGlibc:
    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1

    def malloc_trim(self, pad):
        self.calls.append(("trim", pad))
        return 1


def test_the_setting_lasts_until_its_last_holder_releases_it(monkeypatch):
    libc = _FakeGlibc()
    monkeypatch.setattr(cpu_memory, "_glibc", lambda: libc)
    monkeypatch.setattr(cpu_memory, "_holders", 0)
    retain = [(cpu_memory.M_MMAP_THRESHOLD, cpu_memory.MMAP_THRESHOLD_MAX), (cpu_memory.M_TRIM_THRESHOLD, -1),
              (cpu_memory.M_MMAP_MAX, 0)]
    restore = [*cpu_memory.GLIBC_DEFAULTS, ("trim", 0)]
    assert cpu_memory.apply_cpu_allocator("retain") and cpu_memory.apply_cpu_allocator("retain")  # two runs
    assert libc.calls == retain  # set once
    cpu_memory.release_freed_memory()
    assert libc.calls == retain  # the other run still holds it
    cpu_memory.release_freed_memory()
    assert libc.calls == retain + restore
    cpu_memory.release_freed_memory()  # an extra release changes nothing
    assert libc.calls == retain + restore
    assert not cpu_memory.apply_cpu_allocator("system") and libc.calls == retain + restore


def test_a_trainer_gives_the_allocator_back_when_it_closes(tmp_path, monkeypatch):
    from cohortrl.trainers.grpo import GRPOTrainer

    libc = _FakeGlibc()
    monkeypatch.setattr(cpu_memory, "_glibc", lambda: libc)
    monkeypatch.setattr(cpu_memory, "_holders", 0)
    trainer = GRPOTrainer({"model": {"name": "tiny-llama"}, "data": {"source": "task:arithmetic"},
                           "algorithm": {"group_size": 2, "prompts_per_step": 1}, "train": {"steps": 1}}, tmp_path / "run")
    assert cpu_memory._holders == 1 and libc.calls[0] == (cpu_memory.M_MMAP_THRESHOLD, cpu_memory.MMAP_THRESHOLD_MAX)
    trainer.close()
    assert cpu_memory._holders == 0 and libc.calls[-1] == ("trim", 0)
    assert cpu_memory.retain_freed_memory() and cpu_memory._holders == 1  # another holder, e.g. a second trainer
    trainer.close()  # closing again gives back nothing: the other holder keeps the setting
    assert cpu_memory._holders == 1


def test_a_run_trims_the_heap_every_n_steps_and_never_by_default(tmp_path, monkeypatch):
    """``train.cpu_heap_trim_every: N``: after steps N, 2N, ... the loop has the fast path hand the heap's free
    pages back (``malloc_trim(0)``); 0, the default, never. A negative N is refused in one line."""
    from cohortrl.trainers.grpo import GRPOTrainer

    def run(name, **train):
        libc = _FakeGlibc()
        monkeypatch.setattr(cpu_memory, "_glibc", lambda: libc)
        monkeypatch.setattr(cpu_memory, "_holders", 0)
        trainer = GRPOTrainer({"model": {"name": "tiny-llama"}, "data": {"source": "task:arithmetic"},
                               "sampling": {"max_new_tokens": 4}, "eval": {"n_prompts": 0},
                               "algorithm": {"group_size": 2, "prompts_per_step": 1},
                               "train": {"steps": 5, "progress": False, **train}}, tmp_path / name)
        libc.calls.clear()  # the allocator's settings, made when the run started
        trainer.train()
        trims = [c for c in libc.calls if c == ("trim", 0)]
        trainer.close()
        return len(trims)

    assert run("every2", cpu_heap_trim_every=2) == 2  # after steps 2 and 4
    assert run("default") == 0
    # with PyTorch's kernels and glibc's defaults nothing else of the fast path applies; the trim still does
    assert run("plain", cpu_heap_trim_every=2, cpu_linear="aten", cpu_allocator="system") == 2
    with pytest.raises(ConfigError, match="train.cpu_heap_trim_every"):
        Config.from_dict({"train": {"cpu_heap_trim_every": -1}})
    with pytest.raises(ConfigError, match="train.cpu_heap_trim_every.*cpu_fast_path=off"):
        Config.from_dict({"train": {"cpu_heap_trim_every": 5, "cpu_fast_path": "off"}})


def test_resolution():
    assert resolve_cpu_allocator("auto", "cuda") == "system"
    assert resolve_cpu_allocator("retain", "cuda:0") == "system"
    assert resolve_cpu_allocator("system", "cpu") == "system"
    with pytest.raises(ValueError, match="unknown cpu_allocator 'jemalloc'"):
        resolve_cpu_allocator("jemalloc", "cpu")


def test_without_glibc_auto_leaves_the_allocator_and_retain_is_an_error(monkeypatch):
    monkeypatch.setattr(cpu_memory, "_glibc", lambda: None)
    monkeypatch.setattr(cpu_memory, "_holders", 0)
    assert resolve_cpu_allocator("auto", "cpu") == "system"
    with pytest.raises(RuntimeError, match="Set train.cpu_allocator=auto or system"):
        resolve_cpu_allocator("retain", "cpu")
    assert cpu_memory.retain_freed_memory() is False  # no mallopt: nothing set, nothing claimed


@glibc_only
def test_auto_retains_on_a_cpu_under_glibc():
    assert resolve_cpu_allocator("auto", "cpu") == "retain"


def test_config_key_is_validated():
    assert Config.from_dict({"train": {"cpu_allocator": "system"}}).train.cpu_allocator == "system"
    with pytest.raises(ConfigError, match="cpu_allocator"):
        Config.from_dict({"train": {"cpu_allocator": "jemalloc"}})


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc")
def test_a_mapped_buffer_is_resident_only_where_written_and_returned_when_freed():
    """``mapped_zeros`` (the lean decoder's KV cache and recording): 256 MiB of zeros cost nothing until
    written (reading is free), the 64 MiB written become resident, and all of it goes back when the last view is freed, under
    the retained allocator too (where a heap block would stay). A small buffer comes from the heap."""
    import torch

    assert cpu_memory.retain_freed_memory() or cpu_memory._glibc() is None
    try:
        before = _rss_mib()
        buffer = cpu_memory.mapped_zeros((64, 1024, 1024), torch.float32)  # 256 MiB
        assert buffer.shape == (64, 1024, 1024)
        assert not buffer[:16].any()  # 64 MiB read, never written: the kernel's zero page, not 64 MiB allocated
        assert _rss_mib() - before < 32
        before = _rss_mib()  # (the reduction's own temporaries stay in the retained heap)
        view = buffer[:16]
        view.fill_(1.0)  # 64 MiB written
        assert 60 < _rss_mib() - before < 100
        del buffer  # the view keeps the map alive
        assert view.sum() == 16 * 1024 * 1024 and not view[:, :1].sub(1).any()
        del view
        assert _rss_mib() - before < 8
        small = cpu_memory.mapped_zeros((4, 4), torch.float32)
        assert small.shape == (4, 4) and not small.any()
    finally:
        cpu_memory.release_freed_memory()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc")
def test_a_mapped_buffers_tail_goes_back_to_the_os():
    """``release_tail`` (the KV cache once rows left the products): the pages from the page the offset falls in
    onwards leave resident memory and read as zeros; what comes before keeps its values. A tensor from the heap
    (under ``MAPPED_MIN_BYTES``) is left alone."""
    import torch

    buffer = cpu_memory.mapped_zeros((32, 1024, 1024), torch.float32)  # 128 MiB
    buffer.fill_(1.0)
    before = _rss_mib()
    cpu_memory.release_tail(buffer[:8], 8 * 1024 * 1024 * 4 + 1)  # a view's storage is the map; 32 MiB + 1 byte on
    assert 90 < before - _rss_mib() < 100  # 96 MiB less one page
    flat = buffer.view(-1)
    boundary = 8 * 1024 * 1024 + 4096 // 4  # the first float of the first page released
    assert flat[:boundary].eq(1).all() and not flat[boundary:].any()
    small = cpu_memory.mapped_zeros((4, 4), torch.float32).fill_(2.0)
    cpu_memory.release_tail(small, 0)
    assert small.eq(2).all()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc")
def test_kept_recording_maps_keep_only_what_every_row_wrote():
    """``RecordingMaps``: a lent buffer is all zeros, even in a map an earlier call filled; the part marked as
    written by every row stays resident for the next call (the same map, no new pages), and what was written past
    the mark goes back to the OS at the end of the step; a map a tensor still views is never lent again; a slot
    keeps one unused map."""
    import torch

    maps = cpu_memory.RecordingMaps()
    buffer = maps.zeros("slot", (64, 1024, 1024), torch.float32)  # 256 MiB
    address = buffer.data_ptr()
    buffer.fill_(float("nan"))  # all written
    maps.mark_reusable(buffer[:16], buffer[:16].nbytes)  # the first 64 MiB written by every row
    other = maps.zeros("slot", (64, 1024, 1024), torch.float32)
    assert other.data_ptr() != address  # viewed: a map of its own
    del buffer, other
    before = _rss_mib()
    maps.end_of_step()
    assert len(maps._maps["slot"]) == 1  # the map with the marked part kept, the other (never written) let go
    assert 150 < before - _rss_mib() < 200  # the 192 MiB past the mark given back
    again = maps.zeros("slot", (32, 1024, 1024), torch.float32)
    assert again.data_ptr() == address and not again.any()  # the same map, zeros where NaN was
    before = _rss_mib()
    again[:16].fill_(1.0)  # the kept 64 MiB: resident already
    assert _rss_mib() - before < 8
    small = maps.zeros("small", (4, 4), torch.float32)
    assert small.shape == (4, 4) and not small.any() and "small" not in maps._maps
    maps.close()
