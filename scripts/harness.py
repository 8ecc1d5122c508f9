"""The benchmark harness every ``bench_*.py`` script runs through.

    bench = harness.start(args, "Batch image-QA")   # refuses a busy machine, prints the header
    runs = bench.run({"A": run_a, "B": run_b})       # A B A B ... for --rounds rounds
    bench.table(runs, "rps", "requests/s", baseline="B")

- Before anything is measured it checks that the machine is idle (1-minute load average and the
  other processes using CPU, ``harness_load``): a busy machine is refused with the reasons
  (which process, how busy), or with ``--allow-busy`` every output line is marked BUSY.
- The compared variants run interleaved, one measurement of each per round, so a drift of the
  machine (a process starting, thermal state) lands on every variant rather than on one.
- Each figure is printed as the median over the rounds with its spread (min-max); a ratio is the
  ratio of the medians, with the range of the per-round ratios beside it.
- The header says the commit, the machine (cores, torch threads) and the number of rounds.
- ``--smoke`` is every script's smallest run (a test runs it, ``tests/integration/
  test_scripts_smoke.py``): one round, on any machine, busy or not, at the sizes the script
  picks for it (``args.smoke``); its header says SMOKE, and its figures measure nothing.

A variant is a callable returning ``{metric: value}`` for one measurement; it does its own
setup and warm-up outside the part it times.

The API: ``add_arguments``, ``start`` (-> ``Bench``: ``run``, ``table``, ``ratio_line``,
``emit``, ``progress``, ``figures``, ``finish``), and the arithmetic ``spread``, ``ratio``,
``interleave``, ``s_dict``. Scripts import this module, and the other shared ones
(``harness_load``, ``timing``, ``kernel_counts``, ``chart_workload``, ``bench_gpu_models``,
``tiny_data``: modules without a ``main``, which run nothing on import), by their bare names:
``python scripts/NAME.py`` puts ``scripts/`` first on ``sys.path``, and a test imports a script
inside ``tests.scripts.on_path()``. A script may import another's public names (a workload's
shape); no script touches a private member of the package (``kestrel/testing/style_rules.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness_load import Load, busy_reasons, cpu_ticks, cpu_used, descendants, measure_load

__all__ = [
    "Bench", "Runs", "Spread", "Variant", "add_arguments", "interleave", "ratio", "s_dict",
    "spread", "start",
]  # fmt: skip

REPO = Path(__file__).resolve().parents[1]
Runs = dict[str, list[dict[str, float]]]  # variant -> one {metric: value} per round
Variant = Callable[[], Mapping[str, float]]


@dataclass(frozen=True, slots=True)
class Spread:
    median: float
    lo: float
    hi: float

    def fmt(self, f: str = ".2f", suffix: str = "") -> str:
        return f"{self.median:{f}}{suffix} ({self.lo:{f}}-{self.hi:{f}})"


def spread(xs: list[float]) -> Spread:
    if not xs:
        raise ValueError("no measurements")
    return Spread(statistics.median(xs), min(xs), max(xs))


def ratio(num: list[float], den: list[float]) -> Spread:
    """Ratio of the medians, with the min-max of the per-round ratios (rounds paired by index)."""
    if len(num) != len(den) or not num:
        raise ValueError("ratio needs the same, non-zero number of rounds on both sides")
    per_round = [a / b for a, b in zip(num, den, strict=True)]
    return Spread(statistics.median(num) / statistics.median(den), min(per_round), max(per_round))


def interleave(variants: Mapping[str, Variant], rounds: int, log: Callable[[str], None]) -> Runs:
    """Run every variant once per round, in the given order (A B A B ...)."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    runs: Runs = {name: [] for name in variants}
    for r in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            runs[name].append(dict(fn()))
            log(f"round {r + 1}/{rounds}: {name} ({time.perf_counter() - t0:.1f} s)")
    return runs


def add_arguments(p: argparse.ArgumentParser, rounds: int = 3) -> None:
    g = p.add_argument_group("harness")
    g.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds (A B A B ...)")
    g.add_argument("--allow-busy", action="store_true",
                   help="run on a busy machine, marking every output line BUSY")  # fmt: skip
    g.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for the machine to become idle")  # fmt: skip
    g.add_argument("--max-load", type=float, default=max(0.5, 0.25 * (os.cpu_count() or 1)),
                   help="highest 1-minute load average that counts as idle")  # fmt: skip
    g.add_argument("--max-proc-cpu", type=float, default=10.0,
                   help="highest %% of a core another process may use while idle")  # fmt: skip
    g.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    with contextlib.suppress(argparse.ArgumentError):  # a script's own --smoke is kept
        g.add_argument("--smoke", action="store_true",
                       help="the smallest run on any machine: 1 round, busy allowed")  # fmt: skip


def wait_idle(
    args: argparse.Namespace, read: Callable[[], Load], sleep: Callable[[float], None]
) -> tuple[Load, list[str]]:
    """Read the machine until it is idle or ``--wait-idle`` seconds have passed."""
    deadline = time.monotonic() + args.wait_idle
    while True:
        load = read()
        reasons = busy_reasons(load, args.max_load, args.max_proc_cpu)
        if not reasons or time.monotonic() >= deadline:
            return load, reasons
        sleep(min(15.0, max(0.0, deadline - time.monotonic())))


def commit() -> str:
    def git(*a: str) -> str:
        out = subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True)
        return out.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return head + (" (uncommitted changes)" if dirty else "")


def torch_threads(requested: int) -> int | None:
    try:
        import torch
    except ImportError:
        return None
    if requested:
        torch.set_num_threads(requested)
    return torch.get_num_threads()


class Bench:
    """One benchmark run: its header, its busy flag and its output."""

    def __init__(self, args: argparse.Namespace, title: str, load: Load, reasons: list[str]):
        self.args, self.title, self.load, self.reasons = args, title, load, reasons
        self.busy = bool(reasons)
        self.info = {
            "benchmark": title,
            "commit": commit(),
            "cores": load.cores,
            "torch_threads": torch_threads(args.threads),
            "rounds": args.rounds,
            "python": platform.python_version(),
            "load1_at_start": load.load1,
            "busy": self.busy,
            "busy_reasons": reasons,
            "smoke": bool(getattr(args, "smoke", False)),
        }
        self.figures: dict[str, Any] = {}
        self._ticks, self._t0 = cpu_ticks(), time.monotonic()

    def emit(self, line: str = "") -> None:
        """Print a line of the report (not with --json), marked BUSY on a busy machine."""
        if not self.args.json:
            for part in line.split("\n"):
                print(f"BUSY {part}" if self.busy else part, flush=True)

    def progress(self, line: str) -> None:
        print(("BUSY " if self.busy else "") + line, file=sys.stderr, flush=True)

    def header(self) -> None:
        i = self.info
        self.emit(
            f"## {self.title}" + (" (SMOKE: the figures measure nothing)" if i["smoke"] else "")
        )
        self.emit(
            f"commit {i['commit']}; machine: {i['cores']} cores, torch threads "
            f"{i['torch_threads']}, Python {i['python']}; {i['rounds']} rounds, variants "
            f"interleaved; median (min-max) over the rounds"
        )
        state = "idle" if not self.busy else "BUSY: " + "; ".join(self.reasons)
        self.emit(f"machine at start: load {self.load.load1:.2f}, {state}")

    def run(self, variants: Mapping[str, Variant]) -> Runs:
        return interleave(variants, self.args.rounds, self.progress)

    def table(
        self,
        runs: Runs,
        metrics: Mapping[str, str],
        baseline: str | Mapping[str, str] | None = None,
        fmt: str = ".2f",
    ) -> None:
        """One row per variant: each metric's median (min-max), and the first metric's ratio
        to the variant's baseline (median ratio, per-round range)."""
        base = dict.fromkeys(runs, baseline) if isinstance(baseline, str) else dict(baseline or {})
        first = next(iter(metrics))
        vs = f"vs {baseline}" if isinstance(baseline, str) else "vs baseline"
        head = ["variant", *metrics.values()] + ([f"{metrics[first]} {vs}"] if base else [])
        self.emit("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for name, rounds in runs.items():
            cells = [name]
            for m in metrics:
                values = [r[m] for r in rounds]
                cells.append(spread(values).fmt(fmt))
                self.figures.setdefault(name, {})[m] = {**s_dict(spread(values)), "rounds": values}
            if base and base.get(name):
                q = ratio([r[first] for r in rounds], [r[first] for r in runs[base[name]]])
                named = "" if isinstance(baseline, str) else f" vs {base[name]}"
                cells.append(q.fmt(suffix="x") + named)
                self.figures[f"{name} / {base[name]}: {first}"] = s_dict(q)
            elif base:
                cells.append("-")
            self.emit("| " + " | ".join(cells) + " |")

    def ratio_line(self, label: str, num: list[float], den: list[float]) -> Spread:
        q = ratio(num, den)
        self.figures[label] = s_dict(q)
        self.emit(f"{label}: {q.fmt(suffix='x')} (ratio of medians, per-round range)")
        return q

    def others_during_run(self) -> list[str]:
        """The other processes that were busy over the whole run (alive at its end; this
        process's own children, such as crop workers, are not others)."""
        seconds = max(time.monotonic() - self._t0, 1e-3)
        procs = cpu_used(self._ticks, cpu_ticks(), seconds, descendants(os.getpid()))
        return busy_reasons(Load(0.0, self.load.cores, procs), math.inf, self.args.max_proc_cpu)

    def finish(self, extra: Mapping[str, object] | None = None) -> None:
        """Say whether other processes ran beside the benchmark, then the JSON (--json)."""
        during = self.others_during_run()
        self.info["busy_during_run"] = during
        self.emit("")
        if during:
            self.busy = True
            self.emit("machine during the run: BUSY, the figures above are disturbed: "
                      + "; ".join(during))  # fmt: skip
        else:
            self.emit("machine during the run: no other process over "
                      f"{self.args.max_proc_cpu:g}% of a core")  # fmt: skip
        if self.args.json:
            print(json.dumps({**self.info, "figures": self.figures, **(extra or {})}))


def s_dict(s: Spread) -> dict[str, float]:
    return {"median": s.median, "min": s.lo, "max": s.hi}


def start(
    args: argparse.Namespace,
    title: str,
    read: Callable[[], Load] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Bench:
    """Check the machine, refuse it when busy (unless --allow-busy or --smoke), print the
    header. ``--smoke`` sets one round and allows a busy machine."""
    smoke = getattr(args, "smoke", False)
    if smoke:
        args.rounds, args.allow_busy = 1, True
    interval = 0.05 if smoke else 1.0  # a smoke run only marks a busy machine
    reader = read or (lambda: measure_load(interval, exclude=frozenset({os.getpid()})))
    load, reasons = wait_idle(args, reader, sleep)
    if reasons and not args.allow_busy:
        raise SystemExit(
            f"{title}: the machine is busy, refusing to measure:\n  - "
            + "\n  - ".join(reasons)
            + "\nwait for it to become idle (--wait-idle S), or mark the output with --allow-busy"
        )
    bench = Bench(args, title, load, reasons)
    bench.header()
    return bench
