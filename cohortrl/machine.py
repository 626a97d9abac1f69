"""Where a run ran: the facts about the machine that decide how its floats round.

The same code and seed give bit-identical runs on one machine, and different ones elsewhere: oneDNN and MKL
choose kernels and blockings by the CPU's instruction sets and cache sizes, so a reduction adds its terms in
another order. Two cloud machines that both call themselves "AMD EPYC" can differ this way (their hypervisor
hides the exact part), so the CPU's family, model, stepping, microcode and caches are kept with each sweep
attempt, and a report says which runs shared a machine (docs/engineering.md, "A warm start whose seeds agree").

Standard library only: the sweep's parent process records it without importing torch.
"""

from __future__ import annotations

import hashlib
import os
import platform
from importlib import metadata
from pathlib import Path

# The instruction sets oneDNN and MKL dispatch on (x86); the full flag list is kept as a digest.
_ISA = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpuinfo() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo, field by field (empty where there is none): the one reader
    of that file for the library, its benchmarks and the golden runs' key."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _caches() -> str:
    """cpu0's data and unified caches by level, e.g. ``L1d 32K, L2 1024K, L3 32768K``."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    found = []
    for index in sorted(root.glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if kind != "Instruction":
            found.append(f"L{level}{'d' if kind == 'Data' else ''} {size}")
    return ", ".join(found)


def describe() -> dict:
    """This machine as a flat dict of strings and ints (JSON-ready); fields the platform cannot tell are absent."""
    info = cpuinfo()
    flags = info.get("flags", "").split()
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 0
    found = {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "vendor": info.get("vendor_id"),
        "family": info.get("cpu family"),
        "model": info.get("model"),
        "stepping": info.get("stepping"),
        "microcode": info.get("microcode"),
        "caches": _caches() or None,
        "isa": " ".join(f for f in _ISA if f in flags) or None,
        "flags_digest": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12] if flags else None,
        "cores": cores,
        "torch": torch_version,
    }
    return {k: v for k, v in found.items() if v is not None}


def label(machine: dict) -> str:
    """One line a reader can compare: ``AMD EPYC (family 25 model 17 stepping 1, microcode 0x1000065; L1d 32K,
    L2 1024K, L3 32768K; avx2 ... ; flags 3f2a...; 2 cores; torch 2.13.0+cpu)``."""
    ident = " ".join(f"{k} {machine[k]}" for k in ("family", "model", "stepping") if k in machine)
    parts = [p for p in (
        ident + (f", microcode {machine['microcode']}" if "microcode" in machine else ""),
        machine.get("caches"),
        machine.get("isa"),
        f"flags {machine['flags_digest']}" if "flags_digest" in machine else None,
        f"{machine['cores']} cores" if "cores" in machine else None,
        f"torch {machine['torch']}" if "torch" in machine else None,
    ) if p]
    return f"{machine.get('cpu', 'unknown CPU')} ({'; '.join(parts)})"
