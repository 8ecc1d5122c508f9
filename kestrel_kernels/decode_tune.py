"""Which kernel serves decode attention at each batch size, chosen by measuring both at start-up.

Decode attention has two kernels on CUDA: FlashAttention's paged kernel (the ``fa`` backend)
and the Triton flash-decoding kernel (``triton_decode``). Which is faster depends on the GPU,
the batch size and the head layout, so with ``KESTREL_DECODE_KERNEL=auto`` (the default) a
CUDA runtime measures them before it captures its decode graphs (``tune_pool``):

- for each decode batch size, rows of about ``POSITIONS`` keys each (scattered pages of the
  runtime's own KV pool, idle at start-up, filled with random values) behind a page table as
  wide as the runtime's, and random queries;
- both kernels run once and their outputs are compared: the Triton kernel is considered only
  where it agrees with FlashAttention within ``TOLERANCE`` of the largest magnitude;
- each is then timed (``graph_ms``: ``calls`` calls captured in one CUDA graph, replayed, the
  median per call), the Triton kernel in each of its launch configurations (``CANDIDATES``:
  heads per program, positions per iteration, warps, programs aimed for), and Triton serves
  that batch size, in its fastest configuration, only if that is at least ``MARGIN`` faster.

The choices make the runtime's decode route (``route_of``: a ``decode_route.DecodeRoute``, held
by the ``backends.TritonDecode`` the runtime serves on) before the graphs are captured, so each
bucket's graph holds the kernel chosen for its size; the trials are logged and kept
(``MoondreamRuntime.decode_trials``). ``compare`` is the decision itself, a pure function of
two calls and a timer (the CPU tests drive it with the torch reference, the Triton interpreter
and a stand-in timer).
"""

from __future__ import annotations

import functools
import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kestrel_kernels.contract import AttentionMeta, default_scale
from kestrel_kernels.decode_route import DecodeRoute
from kestrel_kernels.triton_decode import DecodeConfig

if TYPE_CHECKING:
    from kestrel_kernels.plan import AttentionBackend

__all__ = [
    "CANDIDATES",
    "MARGIN",
    "POSITIONS",
    "TOLERANCE",
    "DecodeCase",
    "DecodeTrial",
    "check_fp8",
    "compare",
    "decode_case",
    "graph_ms",
    "route_of",
    "tune_pool",
]

log = logging.getLogger("kestrel.kernels")

POSITIONS = 800  # keys per row timed: an image prompt and a short answer
TOLERANCE = 2e-2  # of the largest magnitude: bf16 rounding of two summation orders
MARGIN = 0.05  # Triton must be this much faster to be chosen
# The Triton kernel's launch configurations tried at each batch size: the default first guess,
# longer and shorter position blocks, wider head blocks on more warps, more split programs.
CANDIDATES = (
    DecodeConfig(),
    DecodeConfig(block_n=8),
    DecodeConfig(block_n=16, num_warps=8),
    DecodeConfig(heads=16, num_warps=8),
    DecodeConfig(target_programs=4096),
)


@dataclass(frozen=True, slots=True)
class DecodeTrial:
    """One batch size's measurement: each kernel's ms per call (None: not timed; Triton's in
    its fastest configuration ``config``), their largest difference relative to the largest
    magnitude, the choice and why."""

    batch: int
    fa_ms: float | None
    triton_ms: float | None
    max_diff: float
    choice: str
    reason: str
    config: DecodeConfig | None = None


@dataclass(frozen=True, slots=True)
class DecodeCase:
    """Decode inputs: ``q`` [B, 1, H, D], K/V pages, page table [B, width], keys per row."""

    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    page_table: Tensor
    seqused_k: Tensor

    @property
    def meta(self) -> AttentionMeta:
        return AttentionMeta(self.page_table, self.seqused_k)


def decode_case(
    k_cache: Tensor, v_cache: Tensor, batch: int, width: int, heads: int, seed: int = 0,
    q_dtype: torch.dtype | None = None, fill: bool = True,
) -> DecodeCase:  # fmt: skip
    """Rows of about ``POSITIONS`` keys (fewer when the pages run short) over scattered pages
    of ``k_cache`` / ``v_cache``, whose values (page 0, the scratch page, aside) are
    overwritten with random ones (``fill``; a later case over the same pages may skip it);
    random queries in ``q_dtype`` (default: the pages')."""
    dev, n_pages = k_cache.device, k_cache.shape[0]
    per_row = max(1, min(POSITIONS, width, (n_pages - 1) // batch))
    lens = [per_row - (37 * b) % max(1, per_row // 12) for b in range(batch)]
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = (torch.randperm(n_pages - 1, generator=g)[: sum(lens)] + 1).to(torch.int32)
    table = torch.zeros(batch, width, dtype=torch.int32)
    for b, row in enumerate(pages.split(lens)):
        table[b, : len(row)] = row
    if fill:
        for pages_ in (k_cache, v_cache):
            _randomize(pages_[1:])
    q = torch.randn(batch, 1, heads, k_cache.shape[-1], generator=g)
    q = q.to(dev, q_dtype or k_cache.dtype)
    seqused_k = torch.tensor(lens, dtype=torch.int32, device=dev)
    return DecodeCase(q, k_cache, v_cache, table.to(dev), seqused_k)


def _randomize(pages: Tensor) -> None:
    """Random values in place (no temporary as large as the pool): normal for float pages;
    for FP8 pages, random bit patterns of finite values of either sign."""
    if pages.element_size() == 1 and pages.is_floating_point():
        bits = pages.view(torch.uint8)
        bits.random_(0, 0x70)  # e4m3: exponents up to 14, never the NaN pattern
        bits.bitwise_or_(torch.randint_like(bits, 0, 2) << 7)
    else:
        pages.normal_()


def graph_ms(fn: Callable[[], Tensor], calls: int = 20, repeats: int = 5) -> float:
    """CUDA milliseconds per ``fn()``: ``calls`` of them captured in one graph (after a warm
    call on a side stream), the graph replayed ``repeats`` times, the median divided out."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def compare(
    batch: int,
    fa: Callable[[], Tensor],
    triton: Mapping[DecodeConfig, Callable[[], Tensor]],
    timer: Callable[[Callable[[], Tensor]], float],
) -> DecodeTrial:
    """The decision for one batch size (module doc): each Triton configuration must agree with
    FlashAttention to be timed; the fastest that agrees must beat it by ``MARGIN``."""
    want = fa()
    diffs = {config: _relative_diff(want, fn()) for config, fn in triton.items()}
    agreeing = [config for config, diff in diffs.items() if diff <= TOLERANCE]  # NaN: no
    if not agreeing:
        worst = max(diffs.values(), default=float("nan"))
        return DecodeTrial(batch, None, None, worst, "fa", f"triton differs by {worst:.3g}")
    fa_ms = timer(fa)
    timed = {config: timer(triton[config]) for config in agreeing}
    best = min(timed, key=timed.__getitem__)
    faster = timed[best] <= fa_ms * (1 - MARGIN)
    return DecodeTrial(batch, fa_ms, timed[best], diffs[best], "triton" if faster else "fa",
                       "faster" if faster else "triton not faster", best)  # fmt: skip


def tune_pool(
    k_cache: Tensor,
    v_cache: Tensor,
    batches: Sequence[int],
    width: int,
    heads: int,
    *,
    baseline: AttentionBackend | None = None,
    timer: Callable[[Callable[[], Tensor]], float] = graph_ms,
    candidates: Sequence[DecodeConfig] = CANDIDATES,
) -> list[DecodeTrial]:
    """One trial per batch size over the pool's pages ``k_cache`` / ``v_cache`` (one layer's,
    idle: their values are overwritten), at the default softmax scale; ``baseline``: the
    backend the Triton kernel is measured against (None: FlashAttention; the torch backend in
    the CPU tests); ``candidates``: its configurations."""
    from kestrel_kernels.backends import FLASH
    from kestrel_kernels.decode_route import decode_kernel_forced
    from kestrel_kernels.triton_decode import paged_decode

    baseline = baseline or FLASH
    softmax_scale = default_scale(k_cache.shape[-1], None)
    trials = []
    for i, batch in enumerate(batches):  # the pool is filled once, for the first case
        c = decode_case(k_cache, v_cache, batch, width, heads, seed=batch, fill=i == 0)
        plan = baseline.plan(AttentionMeta(c.page_table, c.seqused_k), 1)

        def fa(c: DecodeCase = c, plan=plan) -> Tensor:
            return baseline.forward(c.q, c.k_cache, c.v_cache, plan, softmax_scale=softmax_scale)

        def triton(config: DecodeConfig, c: DecodeCase = c) -> Tensor:
            return paged_decode(c.q[:, 0], c.k_cache, c.v_cache, c.meta,
                                softmax_scale=softmax_scale, config=config)[:, None]  # fmt: skip

        fns = {config: functools.partial(triton, config) for config in candidates}
        with decode_kernel_forced("fa"):  # the baseline runs its own kernel, whatever is set
            trial = compare(batch, fa, fns, timer)
        log.info("decode kernel for batch %d: %s (%s; fa %s ms, triton %s ms in %s, diff %.2g)",
                 batch, trial.choice, trial.reason, trial.fa_ms, trial.triton_ms, trial.config,
                 trial.max_diff)  # fmt: skip
        trials.append(trial)
    return trials


def check_fp8(
    k_cache: Tensor,
    v_cache: Tensor,
    scales,
    batches: Sequence[int],
    width: int,
    heads: int,
    *,
    softmax_scale: float,
    q_dtype: torch.dtype,
) -> list[DecodeTrial]:
    """Whether the Triton kernel over FP8 pages (with their ``scales``) agrees with the scaled
    torch reference at each batch size; nothing is timed (the reference reads lengths on the
    host, so it cannot be graph-captured: the kernel serves FP8 decode wherever it agrees)."""
    from kestrel_kernels.attention import paged_attention
    from kestrel_kernels.backends import TORCH
    from kestrel_kernels.decode_route import decode_kernel_forced
    from kestrel_kernels.triton_decode import paged_decode

    trials = []
    for i, batch in enumerate(batches):
        c = decode_case(k_cache, v_cache, batch, width, heads, seed=batch, q_dtype=q_dtype,
                        fill=i == 0)  # fmt: skip
        with decode_kernel_forced("fa"):
            want = paged_attention(c.q, c.k_cache, c.v_cache, c.meta, backend=TORCH,
                                   softmax_scale=softmax_scale, kv_scales=scales)  # fmt: skip
        got = paged_decode(c.q[:, 0], c.k_cache, c.v_cache, c.meta,
                           softmax_scale=softmax_scale, kv_scales=scales)[:, None]  # fmt: skip
        diff = _relative_diff(want, got)
        ok = diff <= TOLERANCE
        trials.append(DecodeTrial(batch, None, None, diff, "triton" if ok else "fa",
                                  "agrees" if ok else f"triton differs by {diff:.3g}"))  # fmt: skip
        log.info("FP8 decode, batch %d: %s", batch, trials[-1].reason)
    return trials


def route_of(trials: Sequence[DecodeTrial], *, fp8: bool = False) -> DecodeRoute:
    """The decode route ``trials`` chose: each batch size's kernel and the Triton kernel's
    fastest configuration; ``fp8``: they are ``check_fp8``'s, and the kernel serves FP8 pages
    only if it agreed at every size."""
    if fp8:
        return DecodeRoute(fp8=bool(trials) and all(t.choice == "triton" for t in trials))
    configs = {t.batch: t.config for t in trials if t.config is not None}
    return DecodeRoute({t.batch: t.choice for t in trials}, configs=configs)


def _relative_diff(want: Tensor, got: Tensor) -> float:
    scale = float(want.float().abs().max()) or 1.0
    return float((got.float() - want.float()).abs().max()) / scale
