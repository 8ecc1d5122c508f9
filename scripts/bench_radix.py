"""Radix prefix cache micro-benchmark: match / insert / evict / lock in microseconds.

No model: the cache and page table are pure Python. The tree is populated like a busy server:
hundreds of image namespaces (``[BOS, ImageToken(h, 729), stem, question]``, several questions
per image) and dozens of adapter namespaces holding 1024-token text prompts that share a
900-token system prefix. Each figure is the median (and p90) of many timed calls
(``time.perf_counter_ns``, GC paused while timing).

    python scripts/bench_radix.py            # full tree (~3,000 nodes, ~360 namespaces)
    python scripts/bench_radix.py --quick    # small tree, fewer repetitions (a few seconds)

Targets (design.md 7 / the radix task): a miss < 10 us, matching a 1,000-token cached prefix
< 100 us, inserting a 100-token suffix < 50 us.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable

from kestrel.kv_cache import PageTable
from kestrel.prefix_cache import CacheNamespace, ImageToken, RadixPrefixCache, TextToken

BOS = 0
IMAGE_KV = 729  # Moondream 2's image token count; a benchmark parameter here, not model code
SYSTEM_LEN, PROMPT_LEN = 900, 1024


def text(rng: random.Random, n: int) -> list[TextToken]:
    return [TextToken(rng.randrange(1, 50_000)) for _ in range(n)]


def image_prompt(h: int, stem: list, question: list) -> list:
    return [TextToken(BOS), ImageToken(h, IMAGE_KV), *stem, *question]


class Bench:
    def __init__(self, quick: bool, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.n_img, self.q_per_img = (40, 4) if quick else (300, 8)
        self.n_lora, self.s_per_lora = (8, 4) if quick else (60, 8)
        self.reps = 300 if quick else 2000
        pages = self.n_img * (IMAGE_KV + 40 + self.q_per_img * 20)
        pages += self.n_lora * (PROMPT_LEN + self.s_per_lora * (PROMPT_LEN - SYSTEM_LEN))
        self.pt = PageTable(pages + 100_000, max_batch_size=4)
        self.cache = RadixPrefixCache(self.pt)
        self.pt.set_prefix_cache(self.cache)
        self.stem = text(self.rng, 12)
        self.img_prompts: list[tuple[list, CacheNamespace]] = []
        self.text_prompts: list[tuple[list, CacheNamespace]] = []
        self.systems: dict[CacheNamespace, list] = {}
        self._populate()

    def cached_insert(self, tokens: list, ns: CacheNamespace):
        """The runtime's path: match, fresh pages for the suffix, insert from the match."""
        m = self.cache.match_prefix(tokens, ns)
        n_new = sum(t.kv_length() for t in m.unmatched_tokens)
        pages = m.matched_pages + self.pt.allocate_pages(n_new)
        return self.cache.insert(
            tokens, pages, ns, m.last_node, m.matched_token_count, m.matched_kv_length
        )

    def _populate(self) -> None:
        for i in range(self.n_img):
            ns = CacheNamespace(image_hash=i + 1)
            for _ in range(self.q_per_img):
                toks = image_prompt(i + 1, self.stem, text(self.rng, self.rng.randint(6, 18)))
                self.cached_insert(toks, ns)
                self.img_prompts.append((toks, ns))
        for i in range(self.n_lora):
            ns = CacheNamespace(lora_id=f"adapter{i}@{i:016x}")
            system = [TextToken(BOS), *text(self.rng, SYSTEM_LEN - 1)]
            self.systems[ns] = system
            for _ in range(self.s_per_lora):
                toks = system + text(self.rng, PROMPT_LEN - SYSTEM_LEN)
                self.cached_insert(toks, ns)
                self.text_prompts.append((toks, ns))

    def time_us(self, fn: Callable[[int], object], setup: Callable[[int], object] | None = None):
        """Median and p90 of ``fn(i)`` in microseconds; ``setup(i)`` runs untimed first."""
        samples = []
        gc.disable()
        try:
            for i in range(self.reps):
                if setup is not None:
                    setup(i)
                t0 = time.perf_counter_ns()
                fn(i)
                samples.append(time.perf_counter_ns() - t0)
        finally:
            gc.enable()
        samples.sort()
        return statistics.median(samples) / 1e3, samples[int(0.9 * len(samples))] / 1e3

    def run(self) -> list[tuple[str, float, float, str]]:
        c, rng = self.cache, self.rng
        rows = []

        def add(name: str, fn, setup=None, target: float | None = None):
            med, p90 = self.time_us(fn, setup)
            verdict = "" if target is None else ("met" if med < target else "MISSED")
            rows.append((name, med, p90, f"< {target:g} us {verdict}" if target else ""))

        img, ns_img = self.img_prompts[len(self.img_prompts) // 2]
        txt, ns_txt = self.text_prompts[len(self.text_prompts) // 2]
        unknown = CacheNamespace(image_hash=10**9)
        add(
            "match miss: image prompt, unknown namespace",
            lambda i: c.match_prefix(img, unknown),
            target=10,
        )
        stray = [TextToken(7), *txt[1:]]
        add(
            "match miss: 1024-token text, known namespace",
            lambda i: c.match_prefix(stray, ns_txt),
            target=10,
        )
        add(
            f"match hit: image prompt ({len(img)} tokens, {sum(t.kv_length() for t in img)} KV)",
            lambda i: c.match_prefix(img, ns_img),
        )
        add(
            "match hit: 1024-token text prompt, fully cached",
            lambda i: c.match_prefix(txt, ns_txt),
            target=100,
        )
        fresh_q = image_prompt(ns_img.image_hash, self.stem, text(rng, 12))
        add("match partial: image prompt, new question", lambda i: c.match_prefix(fresh_q, ns_img))

        # insert: a 100-token suffix after a 1,000-token match (the runtime's from_node path)
        system = self.systems[ns_txt]
        jobs: list = []

        def prep_suffix(i: int) -> None:
            toks = system + text(rng, 100)
            m = c.match_prefix(toks, ns_txt)
            pages = m.matched_pages + self.pt.allocate_pages(len(toks) - m.matched_kv_length)
            jobs.append((toks, pages, m))

        def do_insert(i: int) -> None:
            toks, pages, m = jobs[-1]
            c.insert(toks, pages, ns_txt, m.last_node, m.matched_token_count, m.matched_kv_length)

        add("insert: 100-token suffix after a 900-token match", do_insert, prep_suffix, target=50)

        def prep_img(i: int) -> None:
            toks = image_prompt(ns_img.image_hash, self.stem, text(rng, 15))
            m = c.match_prefix(toks, ns_img)
            pages = m.matched_pages + self.pt.allocate_pages(len(m.unmatched_tokens))
            jobs.append((toks, pages, m))

        def do_insert_img(i: int) -> None:
            toks, pages, m = jobs[-1]
            c.insert(toks, pages, ns_img, m.last_node, m.matched_token_count, m.matched_kv_length)

        add("insert: 15-token question after image prefix", do_insert_img, prep_img)

        def prep_miss(i: int) -> None:
            toks = [TextToken(BOS), *text(rng, PROMPT_LEN - 1)]
            jobs.append((toks, self.pt.allocate_pages(PROMPT_LEN), CacheNamespace(f"m{i}@x")))

        add(
            "insert: 1024-token prompt, new namespace (miss)",
            lambda i: c.insert(jobs[-1][0], jobs[-1][1], jobs[-1][2]),
            prep_miss,
        )

        deep = c.match_prefix(txt, ns_txt).last_node
        add("lock + unlock: 2-deep path", lambda i: (c.lock(deep), c.unlock(deep)))
        add("evict(1): one LRU leaf, pages back to the pool", lambda i: c.evict(1))
        return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small tree, fewer repetitions")
    args = ap.parse_args()
    t0 = time.perf_counter()
    bench = Bench(args.quick)
    built = time.perf_counter() - t0
    c = bench.cache
    print(
        f"tree: {c.node_count} nodes, {c.namespace_count} namespaces, "
        f"{c.total_cached_pages} cached pages (built in {built:.1f} s); "
        f"{bench.reps} timed calls per row"
    )
    rows = bench.run()
    width = max(len(r[0]) for r in rows)
    print(f"\n{'operation':<{width}}  {'median us':>9}  {'p90 us':>8}  target")
    print("-" * (width + 40))
    for name, med, p90, target in rows:
        print(f"{name:<{width}}  {med:>9.1f}  {p90:>8.1f}  {target}")
    c.check_integrity()


if __name__ == "__main__":
    main()
