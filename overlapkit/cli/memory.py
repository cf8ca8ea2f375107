"""Peak resident memory of this process, measured so that spawned ranks are not
credited with their parent's memory.

``getrusage(RUSAGE_SELF).ru_maxrss`` survives ``exec``: Linux keeps the high-water
mark of the process before it, so a rank started with ``spawn`` (fork, then exec)
begins with its parent's RSS at fork time as its "peak". Measured here: after an
``overlapkit bench`` parent had grown, a checkpoint rank's ``ru_maxrss`` never rose
above its starting value, and a peak above baseline read 0. ``VmHWM`` in
``/proc/self/status`` belongs to the process's current address space and starts
afresh at ``exec``.
"""

from __future__ import annotations

import resource

__all__ = ["MMAP_THRESHOLD", "fix_mmap_threshold", "peak_rss_mib", "reset_peak_rss", "rss_mib"]


def _status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return None


def rss_mib() -> float | None:
    """This process's resident set size now, in MiB (``VmRSS``; None without ``/proc``)."""
    return _status_mib("VmRSS:")


def reset_peak_rss() -> bool:
    """Restart the peak (``VmHWM``) from the current RSS, so that a later
    :func:`peak_rss_mib` is the peak of what ran in between; returns whether it could
    (Linux >= 4.0: writing ``5`` to ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def peak_rss_mib() -> float:
    """This process's peak resident set size, in MiB (``VmHWM``; ``ru_maxrss`` where
    ``/proc`` is missing)."""
    peak = _status_mib("VmHWM:")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


#: glibc ``mallopt`` parameter number of M_MMAP_THRESHOLD
_M_MMAP_THRESHOLD = -3
#: allocations from this size on are mmapped, and unmapped when freed
MMAP_THRESHOLD = 128 * 1024


def fix_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at :data:`MMAP_THRESHOLD`, so that every tensor
    buffer above it goes back to the OS when freed. Returns whether it could.

    By default glibc raises the threshold (up to 32 MiB) each time a mapped chunk is
    freed, after which same-sized tensors come from the heap and stay resident when
    freed: peak RSS then measures the allocator's caching as much as live memory,
    and differs between variants that allocate in a different order (docs/benchmarks.md
    has figures both ways).
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False
