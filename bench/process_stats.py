"""This process's memory and the whole machine's CPU use, read from /proc and getrusage (Linux)."""

from __future__ import annotations

import os
import resource


def current_rss_mb() -> float:
    """Resident set size of this process now, in MiB."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far, from /proc/stat (all CPUs)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    return total - fields[3] - fields[4], total


def others_share(before: tuple[int, int], after: tuple[int, int], own_cpu_s: float, wall_s: float) -> float:
    """Share of all the machine's CPUs used by OTHER processes in an interval (0..1; ±1 tick of resolution)."""
    busy = (after[0] - before[0]) / max(1, after[1] - before[1])
    return max(0.0, busy - own_cpu_s / (wall_s * (os.cpu_count() or 1)))
