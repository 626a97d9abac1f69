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

The lean decoder's per-call buffers stay out of that heap: :func:`mapped_zeros` gives each a memory map of its
own (the KV cache), and :class:`RecordingMaps` keeps the recording's maps from one call to the next.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import platform
import sys
import weakref

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
# mapped_zeros's maps by their address (a tensor's storage's data pointer), while a tensor keeps them alive
_maps: "weakref.WeakValueDictionary[int, mmap.mmap]" = weakref.WeakValueDictionary()


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
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    tensor = torch.frombuffer(buffer, dtype=dtype, count=numel)
    _maps[tensor.data_ptr()] = buffer
    return tensor.view(shape)


def release_tail(tensor, offset: int) -> None:
    """Give the pages of ``tensor``'s map (one of :func:`mapped_zeros`) from byte ``offset`` of its storage on,
    rounded up to a page, back to the OS: for a buffer whose tail will not be read again (the KV cache's rows
    that left the products). Nothing for a tensor not in such a map (a small one from the heap), or where
    ``madvise`` is missing."""
    storage = tensor.untyped_storage()
    buffer = _maps.get(storage.data_ptr())
    if buffer is None or not hasattr(buffer, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    _give_back(buffer, offset)


def _give_back(buffer: mmap.mmap, offset: int) -> int:
    """``MADV_DONTNEED`` on ``buffer`` from ``offset`` rounded up to a page to its end (the page ``offset`` falls
    in is kept), read as zeros from then on; returns that page-aligned start (at most the map's length)."""
    start = min(-(-offset // mmap.PAGESIZE) * mmap.PAGESIZE, len(buffer))
    if start < len(buffer):
        buffer.madvise(mmap.MADV_DONTNEED, start, len(buffer) - start)
    return start


class RecordingMaps:
    """The maps one run's recording decoders take their buffers from, kept from one generate call to the next.

    A fresh map (:func:`mapped_zeros`) is faulted in page by page as decoding writes it, at every call. Kept
    maps keep their pages, but only where every row of the last call wrote them: a map that kept every page any
    call wrote would grow towards the whole rows × budget recording (the layout is step-major and a row that has
    ended is not written), which is what made us drop an earlier pool (docs/performance.md). So the decoder
    marks, per buffer, the bytes every row wrote (:meth:`mark_reusable`); when the map is lent again, or at the
    end of a step, everything past that mark goes back to the OS (``MADV_DONTNEED``) and the mark is zeroed.
    A lent tensor is therefore all zeros, as from :func:`mapped_zeros`, and what stays resident between calls
    is one call's fully written part, which the next call's recording overwrites without faulting it in.

    Buffers are kept per ``key`` (the decoder's buffer slot: a layer and what it records), so a small buffer
    never sits in a large one's map. A map is lent again only once no tensor views it (two recordings alive at
    once get maps of their own); a slot keeps one unused map. Blocks under ``MAPPED_MIN_BYTES`` come from
    ``torch.zeros``."""

    SLACK = 1.125  # a new map's room over its request: the next step's slightly longer prompts fit

    def __init__(self):
        self._maps: dict[object, list[_KeptMap]] = {}
        self._by_address: dict[int, _KeptMap] = {}  # a lent tensor's data pointer -> its map

    def zeros(self, key, shape: tuple[int, ...], dtype) -> "torch.Tensor":
        """A zero tensor of ``shape`` in a kept map of slot ``key`` (a new one where none is free or big enough)."""
        import torch

        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if nbytes < MAPPED_MIN_BYTES:
            return torch.zeros(shape, dtype=dtype)
        maps = self._maps.setdefault(key, [])
        kept = next((k for k in maps if k.unused() and len(k.map) >= nbytes), None)
        if kept is None:
            for small in [k for k in maps if k.unused()]:  # too small: let them go (unmapped once dropped)
                self._drop(key, small)
            kept = _KeptMap(-(-int(nbytes * self.SLACK) // mmap.PAGESIZE) * mmap.PAGESIZE)
            maps.append(kept)
            self._by_address[kept.address] = kept
        kept.clean()
        kept.reusable, kept.dirty = 0, True  # until marked, nothing of this call's is reused
        return torch.frombuffer(kept.map, dtype=dtype, count=numel).view(shape)

    def mark_reusable(self, tensor, nbytes: int) -> None:
        """``tensor``, lent by :meth:`zeros`, has its first ``nbytes`` written by every row of the call: they stay
        resident for the next one. A tensor not lent from here is ignored."""
        kept = self._by_address.get(tensor.data_ptr())
        if kept is not None:
            kept.reusable = min(nbytes, len(kept.map))

    def end_of_step(self) -> None:
        """For the maps no tensor views any more (their recordings have been used): what the last call wrote past
        its mark goes back to the OS, and a slot keeps one such map, the one with most to reuse."""
        for key, maps in self._maps.items():
            unused = sorted((k for k in maps if k.unused()), key=lambda k: (k.reusable, len(k.map)))
            for extra in unused[:-1]:
                self._drop(key, extra)
            if unused:
                unused[-1].clean()

    def _drop(self, key, kept: "_KeptMap") -> None:
        self._maps[key].remove(kept)
        del self._by_address[kept.address]

    def close(self) -> None:
        """Let every map go (each unmapped once no tensor views it)."""
        self._maps.clear()
        self._by_address.clear()


class _KeptMap:
    """One kept map of ``nbytes``; ``reusable``: how much of it every row of the last call wrote; ``dirty``: it
    holds values of a call since it was last cleaned."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # MAP_PRIVATE: as mapped_zeros
        self.reusable, self.dirty = 0, False
        view = (ctypes.c_char * 1).from_buffer(self.map)  # the map's address, as a lent tensor's data pointer
        self.address = ctypes.addressof(view)
        del view  # (a live ctypes view would keep the map exported)
        self._own_refs = sys.getrefcount(self.map)  # this attribute's and getrefcount's: no tensor views it

    def unused(self) -> bool:
        # a tensor viewing the map holds a reference to it through its storage's buffer
        return sys.getrefcount(self.map) <= self._own_refs

    def clean(self) -> None:
        """Zero the reusable part (resident: no faults) and give the rest back (read as zeros from then on)."""
        if not self.dirty:
            return
        import torch

        start = _give_back(self.map, self.reusable)  # kept: up to the end of the page the mark ends in
        if start:
            torch.frombuffer(self.map, dtype=torch.uint8, count=start).zero_()
        self.dirty = False
