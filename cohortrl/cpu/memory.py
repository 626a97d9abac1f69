"""Keeping freed memory in the process on a CPU (glibc), so a training step does not fault its pages in again.

PyTorch's CPU tensors come from ``malloc``. glibc serves a request above its mmap threshold with a fresh
``mmap`` (unmapped again on free) and trims the heap's freed top back to the kernel once it exceeds twice
that threshold. The threshold starts at 128 KiB and rises as mapped blocks are freed. A training step
allocates and frees the same large buffers every step (activations, the LM head's logit chunks, oneDNN's
decoding layout), so under these defaults each step touches fresh pages again, and the kernel zero-fills
every 4 KiB page at its first touch. On the machine this library is developed on, a SmolLM2-135M GRPO step
(``benchmarks/vs_trl.py``'s) faulted in 215,000-248,000 pages per step this way, 0.4-0.9 s of system CPU time.

:func:`retain_freed_memory` sets three documented ``mallopt(3)`` parameters: ``M_MMAP_THRESHOLD`` to 32 MiB,
the largest glibc allows on 64-bit (the ceiling its dynamic threshold reaches anyway), ``M_MMAP_MAX`` to 0,
no mmap for any request, and ``M_TRIM_THRESHOLD`` to -1, never trim. Every block then comes from the heap,
and freed ones stay mapped and resident for the next step's requests: the GPU's caching allocator, on a
CPU. With the first and last alone, the same step faulted in no pages from its fourth step on, except the
blocks above the 32 MiB ceiling, which glibc kept mapping afresh: SmolLM2's LM head in decoding's layout
and its weight gradient (113 MB each) and decoding's kept logits (75 MB), 46,000-101,000 faults and
0.16-0.39 s of system time per step. Without mmap they too are reused (0-2,000 faults, 0.04-0.06 s). A
thread's arena cannot grow past 64 MiB, so a larger request from another thread is served by the main
heap instead (glibc retries there). The blocks are the same, so peak resident memory stays about where it
was (the benchmark's SmolLM2 worker peaked at 3848-4072 MB, against 3851 MB before), though how the heap
lays them out varies between processes. What changes is that the heap is not handed back to the OS between
steps, nor at the end. ``train.cpu_allocator: system`` leaves glibc's defaults alone.

The parameters are process-wide by nature: while they are set they apply to every allocation of the process,
including other libraries'. So they are scoped to the runs that asked for them: a trainer sets them when its
run starts and :func:`release_freed_memory` puts glibc's defaults back (128 KiB thresholds, mmap allowed) and
returns the retained heap to the OS when the last such run closes (``Trainer.close``). glibc's dynamic
threshold stays off after that, as any explicit ``mallopt`` leaves it. Only glibc has these parameters; on
macOS, Windows or musl ``auto`` leaves the allocator alone.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import platform

log = logging.getLogger("cohortrl")

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
# mapped_zeros maps blocks from this size on: a map costs a system call and its own page faults, worth it for
# every block big enough to leave a hole in the heap (under the retained allocator glibc maps none itself)
MAPPED_MIN_BYTES = 2**20
# glibc's starting values (DEFAULT_MMAP_THRESHOLD_MIN, DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX), put back on release
GLIBC_DEFAULTS = ((M_MMAP_THRESHOLD, 128 * 1024), (M_TRIM_THRESHOLD, 128 * 1024), (M_MMAP_MAX, 65536))

_holders = 0  # runs of this process that retain freed memory now


def _glibc():
    """The process's C library if it is glibc with ``mallopt``, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") else None


def resolve_cpu_allocator(setting: str, device) -> str:
    """``train.cpu_allocator`` made concrete: ``retain`` or ``system``. ``auto`` retains on a CPU under glibc;
    ``retain`` where glibc is absent is an error rather than a silent no-op."""
    import torch

    if setting not in ("auto", "retain", "system"):
        raise ValueError(f"unknown cpu_allocator {setting!r}: expected 'auto', 'retain' or 'system'")
    if setting == "system" or torch.device(device).type != "cpu":
        return "system"
    if _glibc() is None:
        if setting == "retain":
            raise RuntimeError(
                "train.cpu_allocator=retain needs glibc's mallopt (Linux with glibc); this process runs on "
                f"{platform.system()} {platform.libc_ver()[0] or 'without glibc'}. Set train.cpu_allocator=auto or system."
            )
        return "system"
    return "retain"


def retain_freed_memory() -> bool:
    """Keep freed memory mapped in this process for reuse (see the module docstring) until every caller that
    got True has called :func:`release_freed_memory`. Returns whether it is in effect."""
    global _holders
    if _holders:
        _holders += 1
        return True
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success; -1 for M_TRIM_THRESHOLD is documented as "never trim", 0 for M_MMAP_MAX as
    # "never mmap". The threshold is still set: should M_MMAP_MAX be refused, blocks up to it are retained.
    retaining = all(libc.mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, -1), (M_MMAP_MAX, 0)))
    if not retaining:
        log.warning("mallopt refused M_MMAP_THRESHOLD, M_TRIM_THRESHOLD or M_MMAP_MAX; freed CPU memory may go back "
                    "to the OS as usual")
        _restore(libc)
        return False
    _holders = 1
    return True


def release_freed_memory() -> None:
    """One holder of :func:`retain_freed_memory` is done; after the last, glibc's defaults are back and the freed
    heap goes back to the OS (``malloc_trim``)."""
    global _holders
    if _holders == 0:
        return
    _holders -= 1
    if _holders == 0:
        _restore(_glibc())


def _restore(libc) -> None:
    for param, value in GLIBC_DEFAULTS:
        libc.mallopt(param, value)
    libc.malloc_trim(0)


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim(0)``: freed blocks anywhere in the heap,
    not only at its top), whatever the ``mallopt`` settings; nothing on another C library."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def apply_cpu_allocator(kind: str) -> bool:
    """Put a resolved ``cpu_allocator`` into effect (``system``: nothing to do). Returns whether the caller now
    holds the retained allocator and must call :func:`release_freed_memory` when its run ends."""
    return kind == "retain" and retain_freed_memory()


def mapped_zeros(shape: tuple[int, ...], dtype) -> "torch.Tensor":
    """A zero tensor of ``shape`` in an anonymous memory map of its own, outside the retained heap: its pages
    become resident only when written, and all go back to the OS when the last tensor viewing it is freed.

    For the lean decoder's per-call buffers (KV cache, recording), sized for the whole sampling budget and for
    the step's prompt length, so different in size at every step. Out of a heap that is never trimmed, such
    blocks leave holes the next step's slightly larger ones do not fit, and the heap grew step after step
    (docs/performance.md, the allocator's row, has the measurement). A fresh map costs page faults for what a
    step writes, which the budget-sized allocation mostly does not reach. Blocks under ``MAPPED_MIN_BYTES``
    come from ``torch.zeros`` (the kernel zero-fills a fresh map, so both start at zero)."""
    import torch

    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < MAPPED_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # torch.frombuffer keeps the map alive through the tensor's storage (and every view of it); the map is
    # unmapped when the storage is freed
    # MAP_PRIVATE: a page never written is read as the kernel's shared zero page, not allocated (mmap's default,
    # MAP_SHARED, allocates a page at its first read), and a forked child copies rather than shares
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype, count=numel).view(shape)
