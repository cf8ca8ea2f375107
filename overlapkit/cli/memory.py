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

__all__ = ["peak_rss_mib", "reset_peak_rss", "rss_mib"]


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
