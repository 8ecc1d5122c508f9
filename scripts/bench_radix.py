"""Radix prefix cache micro-benchmark, side by side with Kestrel 0.9.2's own prefix cache.

No model: the cache and page table are pure Python (plus numpy). The tree is populated like a
busy server: hundreds of image namespaces (``[BOS, ImageToken(h, 729), stem, question]``,
several questions per image) and dozens of adapter namespaces holding 1024-token text prompts
that share a 900-token system prefix. In each round both trees are built afresh and every row
is timed on ours, then on 0.9.2's: a row's figure for the round is the median of many timed calls
(``time.perf_counter_ns``, GC paused while timing). Through the benchmark harness (``harness.py``:
idle check, ``--rounds`` rounds), each figure is printed as the median over the rounds (min-max),
and the speedup as the ratio of the medians with its per-round range.

The comparator is the ``kestrel`` 0.9.2 wheel from PyPI (m87-labs' inference engine, whose
``prefix_cache`` package this project's cache descends from). Its ``prefix_cache`` modules and
its token types are loaded from the wheel under private module names (they would clash with
this package's name) and driven with the very same token ids, namespaces and operation order.
Its pages go back to a plain free list, as its ``PageTable`` does (``free_pages.extend`` as the
eviction sink, ``allocate_pages`` slicing the list's tail). Both run in this process, row by
row, so every ratio is measured in one run:

    pip download kestrel==0.9.2 --no-deps -d /tmp/k092
    python scripts/bench_radix.py --kestrel-092 /tmp/k092/kestrel-0.9.2-py3-none-any.whl
    python scripts/bench_radix.py --quick    # small tree, fewer repetitions, ours only
    python scripts/bench_radix.py --smoke    # a tiny tree, a few repetitions, one round

``speedup`` is 0.9.2's median over ours. Targets: a miss < 10 us, matching a 1,000-token
cached prefix < 100 us, inserting a 100-token suffix < 50 us; against 0.9.2 (issue 12):
every match at least 2x faster, every insert and eviction at least as fast.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import random
import statistics
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import harness
import numpy as np

BOS = 0
IMAGE_KV = 729  # Moondream 2's image token count; a benchmark parameter here, not model code
SYSTEM_LEN, PROMPT_LEN = 900, 1024
MATCH_GOAL, WRITE_GOAL = 2.0, 1.0  # speedup over 0.9.2 wanted for matches / inserts + evictions
INNER = 10  # calls per timed sample for the calls that change nothing (matches, lock + unlock)


class Impl:
    """One cache implementation behind the handful of calls the benchmark makes."""

    name = "kestrel (this)"

    def __init__(self, n_pages: int) -> None:
        from kestrel.kv.page_table import PageTable
        from kestrel.prefix_cache import CacheNamespace, ImageToken, RadixPrefixCache, TextToken

        self.pt = PageTable(n_pages, max_batch_size=4)
        self.cache = RadixPrefixCache(self.pt)
        self.pt.set_prefix_cache(self.cache)
        self._ns, self._text, self._image = CacheNamespace, TextToken, ImageToken

    def text(self, ids: list[int]) -> list:
        return [self._text(i) for i in ids]

    def image_prompt(self, h: int, stem: list[int], question: list[int]) -> list:
        return [self._text(BOS), self._image(h, IMAGE_KV), *self.text(stem), *self.text(question)]

    def ns(self, image: int | None = None, lora: str | None = None):
        return self._ns(lora_id=lora, image_hash=image)

    def allocate(self, n: int):
        return self.pt.allocate_pages(n)

    def row_pages(self, matched, fresh):
        """The pages a runtime passes to insert: the matched ones, then the fresh ones."""
        if isinstance(matched, list):
            return matched + list(fresh)
        return np.concatenate((np.asarray(matched, np.int32), np.asarray(fresh, np.int32)))

    def free(self, pages) -> None:
        self.pt.free_pages_to_pool(pages)

    def free_count(self) -> int:
        return self.pt.pages_available


class Kestrel092(Impl):
    """Kestrel 0.9.2's RadixPrefixCache over a free list, as its PageTable keeps it."""

    name = "kestrel 0.9.2"
    modules: tuple | None = None

    def __init__(self, n_pages: int) -> None:
        pc, tokens = self.modules
        self.free_list = list(range(n_pages - 1, 0, -1))
        self.cache = pc.RadixPrefixCache(free_pages_sink=self.free_list.extend)
        self._ns, self._text, self._image = pc.CacheNamespace, tokens.TextToken, pc.ImageToken

    def allocate(self, n: int) -> list[int]:  # PageTable.allocate_pages of 0.9.2, minus torch
        if len(self.free_list) < n:
            self.cache.evict(n - len(self.free_list))
        pages = self.free_list[-n:]
        del self.free_list[-n:]
        return pages

    def row_pages(self, matched, fresh):
        return matched + fresh

    def free(self, pages) -> None:
        self.free_list.extend(pages)

    def free_count(self) -> int:
        return len(self.free_list)

    @classmethod
    def load(cls, wheel: Path) -> None:
        """Unpack the wheel's prefix_cache package and token module under private names."""
        out = Path(tempfile.mkdtemp(prefix="k092_"))
        (out / "k092_prefix_cache").mkdir()
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("kestrel/prefix_cache/") and name.endswith(".py"):
                    target = out / "k092_prefix_cache" / Path(name).name
                    target.write_bytes(zf.read(name))
            (out / "k092_tokens.py").write_bytes(zf.read("kestrel/runtime/tokens.py"))
        sys.path.insert(0, str(out))
        cls.modules = (
            importlib.import_module("k092_prefix_cache"),
            importlib.import_module("k092_tokens"),
        )


class Workload:
    """Token ids of the populated tree and of every timed call, shared by both caches."""

    def __init__(self, quick: bool, seed: int = 0, smoke: bool = False) -> None:
        rng = random.Random(seed)
        self.n_img, self.q_per_img = (4, 2) if smoke else (40, 4) if quick else (300, 8)
        self.n_lora, self.s_per_lora = (2, 2) if smoke else (8, 4) if quick else (60, 8)
        self.reps = 10 if smoke else 300 if quick else 2000
        self.evict_reps = 1 if smoke else 5

        def ids(n: int) -> list[int]:
            return [rng.randrange(1, 50_000) for _ in range(n)]

        self.stem = ids(12)
        self.questions = [[ids(rng.randint(6, 18)) for _ in range(self.q_per_img)]
                          for _ in range(self.n_img)]  # fmt: skip
        self.systems = [[BOS, *ids(SYSTEM_LEN - 1)] for _ in range(self.n_lora)]
        self.suffixes = [[ids(PROMPT_LEN - SYSTEM_LEN) for _ in range(self.s_per_lora)]
                         for _ in range(self.n_lora)]  # fmt: skip
        self.fresh_q = ids(12)
        self.new_suffixes = [ids(100) for _ in range(self.reps)]
        self.new_questions = [ids(15) for _ in range(self.reps)]
        self.new_prompts = [[BOS, *ids(PROMPT_LEN - 1)] for _ in range(self.reps)]
        self.pages = self.n_img * (IMAGE_KV + 40 + self.q_per_img * 20)
        self.pages += self.n_lora * (PROMPT_LEN + self.s_per_lora * (PROMPT_LEN - SYSTEM_LEN))
        self.pages += (self.reps + 10) * (PROMPT_LEN + 120)


def cached_insert(impl: Impl, tokens: list, ns) -> object:
    """The runtime's path: match, fresh pages for the suffix, insert from the match."""
    m = impl.cache.match_prefix(tokens, ns)
    fresh = impl.allocate(sum(t.kv_length() for t in m.unmatched_tokens))
    pages = impl.row_pages(m.matched_pages, fresh)
    return impl.cache.insert(
        tokens, pages, ns, m.last_node, m.matched_token_count, m.matched_kv_length
    )


def populate(impl: Impl, w: Workload) -> None:
    for i in range(w.n_img):
        for q in w.questions[i]:
            cached_insert(impl, impl.image_prompt(i + 1, w.stem, q), impl.ns(image=i + 1))
    for i in range(w.n_lora):
        ns = impl.ns(lora=f"adapter{i}@{i:016x}")
        for s in w.suffixes[i]:
            cached_insert(impl, impl.text(w.systems[i] + s), ns)


def time_us(reps: int, fn: Callable[[int], object], setup: Callable[[int], object] | None):
    """Median and p90 of ``fn(i)`` in microseconds; ``setup(i)`` runs untimed first. Calls
    without a setup (they change nothing) are timed ``INNER`` at a time, so the clock's own
    cost does not blur sub-microsecond figures."""
    samples = []
    inner = 1 if setup is not None else INNER
    gc.disable()
    try:
        for i in range(reps):
            if setup is not None:
                setup(i)
            t0 = time.perf_counter_ns()
            for _ in range(inner):
                fn(i)
            samples.append((time.perf_counter_ns() - t0) / inner)
    finally:
        gc.enable()
    samples.sort()
    return statistics.median(samples) / 1e3, samples[int(0.9 * len(samples))] / 1e3


def no_setup(i: int) -> None:
    """A setup that does nothing: the call changes the tree, so it is timed one at a time."""


def request_cycle(impl: Impl, w: Workload, ns) -> tuple[Callable, Callable]:
    """(timed fn, setup) of one request's whole cache protocol, minus the model."""
    c, jobs = impl.cache, []

    def prep(i: int) -> None:
        jobs.append(impl.image_prompt(w.n_img // 2, w.stem, w.new_questions[-1 - i]))

    def cycle(i: int) -> None:
        toks = jobs[-1]
        m = c.match_prefix(toks, ns)
        c.lock(m.last_node)
        fresh = impl.allocate(sum(t.kv_length() for t in m.unmatched_tokens) + 8)
        pages = impl.row_pages(m.matched_pages, fresh[:-8])
        r = c.insert(toks, pages, ns, m.last_node, m.matched_token_count, m.matched_kv_length)
        c.lock(r.node)
        c.unlock(m.last_node)
        c.unlock(r.node)
        impl.free(fresh[-8:])  # the decode budget

    return cycle, prep


def operations(impl: Impl, w: Workload) -> list[tuple[str, Callable, Callable | None, str]]:
    """(row name, timed fn, untimed setup, kind) for one implementation; kind picks the goal."""
    c = impl.cache
    img_ns = impl.ns(image=w.n_img // 2)
    lora_ns = impl.ns(lora=f"adapter{w.n_lora // 2}@{w.n_lora // 2:016x}")
    img = impl.image_prompt(w.n_img // 2, w.stem, w.questions[w.n_img // 2 - 1][1])
    system = w.systems[w.n_lora // 2]
    txt = impl.text(system + w.suffixes[w.n_lora // 2][1])
    stray = impl.text([7, *system[1:]] + w.suffixes[w.n_lora // 2][1])
    fresh_q = impl.image_prompt(w.n_img // 2, w.stem, w.fresh_q)
    unknown = impl.ns(image=10**9)
    jobs: list = []

    def prep(tokens: list, ns) -> None:
        m = c.match_prefix(tokens, ns)
        fresh = impl.allocate(sum(t.kv_length() for t in m.unmatched_tokens))
        jobs.append((tokens, impl.row_pages(m.matched_pages, fresh), ns, m))

    def insert(i: int) -> None:
        toks, pages, ns, m = jobs[-1]
        c.insert(toks, pages, ns, m.last_node, m.matched_token_count, m.matched_kv_length)

    def prep_miss(i: int) -> None:
        jobs.append((impl.text(w.new_prompts[i]), impl.allocate(PROMPT_LEN), f"m{i}@x"))

    def insert_miss(i: int) -> None:
        toks, pages, lora = jobs[-1]
        c.insert(toks, pages, impl.ns(lora=lora))

    deep = c.match_prefix(txt, lora_ns).last_node
    return [
        ("match miss: image prompt, unknown namespace", lambda i: c.match_prefix(img, unknown),
         None, "match<10"),
        ("match miss: 1024-token text, known namespace", lambda i: c.match_prefix(stray, lora_ns),
         None, "match<10"),
        (f"match hit: image prompt ({len(img)} tokens, {IMAGE_KV + len(img) - 1} KV)",
         lambda i: c.match_prefix(img, img_ns), None, "match"),
        ("match hit: 1024-token text prompt, fully cached", lambda i: c.match_prefix(txt, lora_ns),
         None, "match<100"),
        ("match partial: image prompt, new question", lambda i: c.match_prefix(fresh_q, img_ns),
         None, "match"),
        ("insert: 100-token suffix after a 900-token match", insert,
         lambda i: prep(impl.text(system + w.new_suffixes[i]), lora_ns), "write<50"),
        ("insert: 15-token question after image prefix", insert,
         lambda i: prep(impl.image_prompt(w.n_img // 2, w.stem, w.new_questions[i]), img_ns),
         "write"),
        ("insert: 1024-token prompt, new namespace (miss)", insert_miss, prep_miss, "write"),
        ("request cycle: match, lock, allocate, insert, transfer, unlock",
         *request_cycle(impl, w, img_ns), "write"),
        ("lock + unlock: 2-deep path", lambda i: (c.lock(deep), c.unlock(deep)), None, ""),
        ("evict(1): one LRU leaf, pages back to the pool", lambda i: c.evict(1), no_setup,
         "write"),
    ]  # fmt: skip


def evict_all(impl_cls: type[Impl], w: Workload) -> tuple[float, float, int, int]:
    """(median us, p90 us, pages, nodes) of evicting a freshly populated tree at once."""
    samples, pages, nodes = [], 0, 0
    for _ in range(w.evict_reps):
        impl = impl_cls(w.pages)
        populate(impl, w)
        before, nodes = impl.free_count(), getattr(impl.cache, "node_count", 0)
        gc.collect()
        med, _ = time_us(1, lambda i, impl=impl: impl.cache.evict(w.pages), no_setup)
        samples.append(med)
        pages = impl.free_count() - before
    samples.sort()
    return statistics.median(samples), samples[-1], pages, nodes


def verdict(kind: str, med: float, speedup: float | None) -> str:
    out = []
    if "<" in kind:
        limit = float(kind.split("<")[1])
        out.append(f"< {limit:g} us {'met' if med < limit else 'MISSED'}")
    if speedup is not None and kind:
        goal = MATCH_GOAL if kind.startswith("match") else WRITE_GOAL
        out.append(f">= {goal:g}x {'met' if speedup >= goal else 'MISSED'}")
    return ", ".join(out)


def one_round(impls: list[type[Impl]], w: Workload) -> tuple[dict, dict[str, str], str]:
    """Fresh trees for every implementation, then each row timed on each, row by row.

    Returns ({impl name: {row: median us}}, {row: kind}, our tree as populated, before the
    timed calls grow it)."""
    built = []
    for cls in impls:
        impl = cls(w.pages)
        populate(impl, w)
        built.append((cls.name, impl, operations(impl, w)))
    ours = built[0][1].cache
    tree = (f"{ours.node_count} nodes, {ours.namespace_count} namespaces, "
            f"{ours.total_cached_pages} cached pages")  # fmt: skip
    out: dict[str, dict[str, float]] = {name: {} for name, _i, _o in built}
    kinds: dict[str, str] = {}
    for k, (row, *_rest, kind) in enumerate(built[0][2]):
        kinds[row] = kind
        for name, _impl, ops in built:
            out[name][row] = time_us(w.reps, ops[k][1], ops[k][2])[0]
    ours.check_integrity()
    evicted = [evict_all(cls, w) for cls in impls]
    _med, _p90, pages, nodes = evicted[0]  # the row is named by our tree (0.9.2 counts nodes apart)
    row = f"evict all: {pages} pages in {nodes} nodes (median of {w.evict_reps} trees)"
    for cls, (med, *_rest) in zip(impls, evicted, strict=True):
        out[cls.name][row] = med
    kinds[row] = "write"
    return out, kinds, tree


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small tree, fewer repetitions")
    ap.add_argument("--kestrel-092", type=Path, help="kestrel-0.9.2 wheel to compare against")
    harness.add_arguments(ap)
    args = ap.parse_args(argv)
    w = Workload(args.quick, smoke=args.smoke)
    impls: list[type[Impl]] = [Impl]
    if args.kestrel_092 is not None:
        Kestrel092.load(args.kestrel_092)
        impls.append(Kestrel092)
    bench = harness.start(args, "Radix prefix cache micro-benchmark (bench_radix.py)")
    runs: dict[str, list[dict[str, float]]] = {cls.name: [] for cls in impls}
    for r in range(args.rounds):
        t0 = time.perf_counter()
        out, kinds, tree = one_round(impls, w)
        for name, rows in out.items():
            runs[name].append(rows)
        bench.progress(f"round {r + 1}/{args.rounds}: both trees built and timed "
                       f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    bench.emit(f"populated tree: {tree}; {w.reps} timed calls per row and round (median per round)")
    report(bench, runs, kinds, [cls.name for cls in impls])
    bench.finish()


def report(bench: harness.Bench, runs: dict, kinds: dict[str, str], names: list[str]) -> None:
    """One row per operation: our median us (min-max over rounds), 0.9.2's, the speedup."""
    head = ["operation", "median us"]
    if len(names) > 1:
        head += ["0.9.2 median us", "speedup (0.9.2 / ours)"]
    bench.emit("\n| " + " | ".join([*head, "target"]) + " |\n|" + "---|" * (len(head) + 1))
    for row, kind in kinds.items():
        ours_us = [r[row] for r in runs[names[0]]]
        ours = harness.spread(ours_us)
        cells = [row, ours.fmt(".1f")]
        fig: dict[str, object] = {"ours_us": harness.s_dict(ours)}
        speedup = None
        if len(names) > 1:
            theirs_us = [r[row] for r in runs[names[1]]]
            q = harness.ratio(theirs_us, ours_us)
            speedup = q.median
            cells += [harness.spread(theirs_us).fmt(".1f"), q.fmt(suffix="x")]
            fig |= {"kestrel_092_us": harness.s_dict(harness.spread(theirs_us)),
                    "speedup": harness.s_dict(q)}  # fmt: skip
        cells.append(verdict(kind, ours.median, speedup))
        bench.figures[row] = fig
        bench.emit("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
