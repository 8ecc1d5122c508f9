"""Is the machine idle? The benchmark harness's check, read from /proc (Linux).

Two signals: the 1-minute load average (``/proc/loadavg``) and the processes that used CPU
during a short sample (``/proc/<pid>/stat``: user + system ticks, before and after). A busy
machine is one whose load average or any other process is over its limit; the reasons name
the load and each busy process (pid, name, share of one core).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Load",
    "ProcUse",
    "busy_reasons",
    "cpu_ticks",
    "cpu_used",
    "descendants",
    "measure_load",
    "read_load1",
]

PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ProcUse:
    pid: int
    name: str
    cpu_pct: float  # percent of one core over the sample


@dataclass(frozen=True, slots=True)
class Load:
    """One reading of the machine: load average, cores, and the processes that used CPU."""

    load1: float
    cores: int
    procs: tuple[ProcUse, ...]  # busiest first


def read_load1(proc: Path = PROC) -> float:
    return float((proc / "loadavg").read_text().split()[0])


def _stat_ticks(text: str) -> int:
    # the name field is in parentheses and may hold spaces: the fixed fields follow the last ')'
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


def _name(pid_dir: Path) -> str:
    try:
        cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        return " ".join(cmd.split())[:80] or (pid_dir / "comm").read_text().strip()
    except OSError:
        return "?"


def descendants(root: int, proc: Path = PROC) -> frozenset[int]:
    """``root`` and every process below it (a benchmark's own worker processes are not
    "other" processes beside it)."""
    parents: dict[int, int] = {}
    for d in proc.iterdir():
        if d.name.isdigit():
            try:
                text = (d / "stat").read_text()
                parents[int(d.name)] = int(text[text.rindex(")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found = {root}
    grew = True
    while grew:
        below = {pid for pid, parent in parents.items() if parent in found} - found
        found |= below
        grew = bool(below)
    return frozenset(found)


def cpu_ticks(proc: Path = PROC) -> dict[int, int]:
    """pid -> user + system clock ticks so far, for every process readable now."""
    out = {}
    for d in proc.iterdir():
        if d.name.isdigit():
            try:
                out[int(d.name)] = _stat_ticks((d / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue  # gone, or not ours to read
    return out


def cpu_used(
    before: dict[int, int],
    after: dict[int, int],
    seconds: float,
    exclude: frozenset[int] = frozenset(),
    proc: Path = PROC,
) -> tuple[ProcUse, ...]:
    """Each process's CPU share between two ``cpu_ticks`` readings ``seconds`` apart, busiest
    first. A process that appeared in between counts all its ticks; one that ended is missed."""
    hz = os.sysconf("SC_CLK_TCK")
    procs = []
    for pid, ticks in after.items():
        used = ticks - before.get(pid, 0)
        if pid not in exclude and used > 0:
            procs.append(ProcUse(pid, _name(proc / str(pid)), 100.0 * used / hz / seconds))
    return tuple(sorted(procs, key=lambda p: -p.cpu_pct))


def measure_load(
    interval: float = 1.0,
    exclude: frozenset[int] = frozenset(),
    proc: Path = PROC,
    sleep: Callable[[float], None] = time.sleep,
) -> Load:
    """The load average now and each process's CPU share over ``interval`` seconds."""
    before = cpu_ticks(proc)
    sleep(interval)
    after = cpu_ticks(proc)
    before = {pid: before.get(pid, ticks) for pid, ticks in after.items()}  # only the interval
    procs = cpu_used(before, after, interval, exclude, proc)
    return Load(read_load1(proc), os.cpu_count() or 1, procs)


def busy_reasons(load: Load, max_load: float, max_proc_pct: float) -> list[str]:
    """Why the machine is busy; empty when it is idle."""
    reasons = []
    if load.load1 > max_load:
        reasons.append(
            f"1-minute load average {load.load1:.2f} > {max_load:g} ({load.cores} cores)"
        )
    for p in load.procs:
        if p.cpu_pct > max_proc_pct:
            reasons.append(f"pid {p.pid} ({p.name}) uses {p.cpu_pct:.0f}% of a core")
    return reasons
