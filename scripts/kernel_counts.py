"""What ``scripts/count_kernels.py`` runs: a runtime of either family on the branches a GPU takes,
run on a CPU, and the decode / prefill rows it counts (launches, syncs, uploads).

The model is the family's structure (24 text layers, 27 vision layers, 729 patches per crop,
the 730-position BOS + image block; Moondream 3: tau attention and 64 experts, top 8, from
layer 4, FP8 experts as published) at small widths, with random bf16 weights: launch, sync and
upload counts depend on the structure, not on the widths. The runtime runs on ``COUNTING``, the
``fa`` backend object with FlashAttention's torch model as its binding (one launch a call), and
``gpu_branches`` swaps in the rest of what a GPU would run: the Triton kernels under
``TRITON_INTERPRET=1`` (one launch each), and for FP8 experts Hopper's scaled grouped GEMM (its
float32 model, one launch). A row's setup (its prefills and first
decode steps, never counted) runs the torch forms, and the crops' device probe that every
runtime's start-up runs is run once per process: the interpreter is slow.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from kestrel.crops import maker as crop_maker
from kestrel.crops.device import device_disagrees
from kestrel.engine.requests import RequestFactory
from kestrel.images import prepare_image
from kestrel.moondream import moe as moe_module
from kestrel.moondream.config import MoondreamConfig, TextMoeConfig
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.runtime.cuda_graphs import DecodeGraphs
from kestrel.runtime.executor import BatchExecutor
from kestrel.runtime.heads import ModelHeads
from kestrel.runtime.prefill_graphs import PrefillGraphs
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.runtime.vision_graphs import VisionGraphs
from kestrel.scheduler import Request, Scheduler
from kestrel.testing.random_weights import random_model
from kestrel_kernels import contract, fused
from kestrel_kernels.backends import FlashBackend
from kestrel_kernels.counting import LaunchCounter
from kestrel_kernels.segments import VarlenSeqs
from kestrel_kernels.torch_backend import varlen_paged_attention_torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = {"md2": REPO / "tests" / "fixtures" / "md2-tiny-a",
            "md3": REPO / "tests" / "fixtures" / "md3-tiny-a"}  # fmt: skip
MD3_MOE = TextMoeConfig(num_experts=64, start_layer=4, experts_per_token=8, expert_inner_dim=32)
SAMPLED = {"temperature": 0.5, "top_p": 0.3, "max_tokens": 48}
GREEDY = {"temperature": 0.0, "max_tokens": 48}


def fake_binding(
    q, k, v, *, cu_seqlens_q, max_seqlen_q, seqused_k, page_table, softmax_scale, causal, **unused
):
    """FlashAttention's varlen paged call, computed by its torch model (one launch)."""
    from kestrel_kernels.counting import opaque

    with opaque("flash_attn"):
        seqs = VarlenSeqs(1, seqused_k, cu_seqlens_q, max_seqlen_q, causal, softmax_scale)
        out = varlen_paged_attention_torch(q, k[:, 0], v[:, 0], page_table, seqs)
    return out, None


COUNTING = FlashBackend(binding=fake_binding)  # the ``fa`` backend on its torch model


@functools.cache
def _probe_once(config, device: str) -> str | None:
    return device_disagrees(config, device)


@contextlib.contextmanager
def gpu_branches(triton: bool = True):
    """Host-side value checks (CPU only) paused; the Triton kernels (where ``triton`` is
    installed, and asked for); Hopper's FP8 grouped GEMM; the crops' probe run once."""
    probe = crop_maker.device_disagrees  # the crops' device probe (~35 s interpreted): once
    crop_maker.device_disagrees = lambda config, device: _probe_once(config, str(device))
    hopper = moe_module.scaled_grouped_supported
    moe_module.scaled_grouped_supported = lambda device, dtype: True  # FP8 experts: Hopper's GEMM
    fused_before = fused.get_fused_backend()
    if triton and importlib.util.find_spec("triton") is not None:
        fused.set_fused_backend("triton")  # the Triton kernels, interpreted: one launch each
    try:
        with contract.value_checks_paused():  # they read CPU tensors on the host: no GPU path
            yield
    finally:
        fused.set_fused_backend(fused_before)
        moe_module.scaled_grouped_supported = hopper
        crop_maker.device_disagrees = probe


def family_model(family: str, layers: int = 24, small: bool = False) -> MoondreamModel:
    """The family's structure at ``layers`` text layers (``small``: and 2 vision layers)."""
    base = MoondreamConfig.from_json_file(FIXTURES[family] / "config.json")
    text = replace(base.text, n_layers=layers)
    if small:
        base = replace(base, vision=replace(base.vision, enc_n_layers=2))
    if family == "md3":  # MoE from layer 4 (at 24 layers; from layers // 3 below 12)
        text = replace(text, moe=replace(MD3_MOE, start_layer=min(4, layers // 3)))
    md3 = family == "md3"  # FP8 experts, as published
    model = random_model(replace(base, text=text), device="cpu", dtype=torch.bfloat16, seed=0,
                         fp8_experts=md3)  # fmt: skip
    # random weights may end an answer at once: the end-of-text logit is pushed far down, so
    # every counted row keeps decoding (the counts do not depend on the logits' values)
    model.text.lm_head.bias[base.tokenizer.eos_id] = -1e4
    return model


def build(max_batch: int, family: str = "md2", layers: int = 24, small: bool = False):
    model = family_model(family, layers, small)
    cfg = model.config
    rt = MoondreamRuntime(
        model,
        MoondreamTokenizer.for_checkpoint(FIXTURES[family]),
        kv_cache_pages=max_batch * 900 + 4000,
        max_batch_size=max_batch,
        attention_backend=COUNTING,
        device_crops=True,  # as on CUDA: the image's crops cut where the encoder runs
    )
    rt.decode_graphs = DecodeGraphs(
        model,
        rt.kv,
        rt.page_table.page_table,
        max_batch_size=max_batch,
        backend=rt.attention_backend,
        capture=False,
    )
    # the prefill and vision graphs, uncaptured: their launches are the graph bodies
    rt.prefill_graphs = PrefillGraphs(
        model, rt.kv, rt.page_table.page_table, max_batch_size=max_batch,
        backend=rt.attention_backend, capture=False,
    )  # fmt: skip
    rt.vision_graphs = VisionGraphs(model, capture=False)
    executor = BatchExecutor(rt, lookahead=True)  # as on CUDA
    factory = RequestFactory(ModelHeads(model, rt.tokenizer), cfg)
    return rt, executor, Scheduler(executor), factory


_ids = iter(range(1, 1 << 30))


def submit(
    sched: Scheduler, factory: RequestFactory, image, question: str, settings, shape=None
) -> Future:
    """``question`` about ``image`` into ``sched``; ``shape``: a ``response_format``."""
    d = factory.query(image, question, settings, None, reasoning=False, spatial_refs=None,
                      response_format=shape)  # fmt: skip
    fut: Future = Future()
    sched.submit(
        Request(
            request_id=next(_ids),
            skill=d.skill,
            image=d.image,
            adapter=None,
            cache_salt=None,
            prompt_positions=d.prompt_positions,
            max_new_tokens=d.max_new_tokens,
            future=fut,
            build_result=d.build_result,
            submitted_at=time.perf_counter(),
        )
    )
    return fut


def picture(seed: int, h: int = 756, w: int = 1512):
    rng = np.random.default_rng(seed)
    return prepare_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def pictures(small: bool):
    """``picture``, or (``small``, a smoke run's) one of a single crop."""
    return (
        (lambda seed, h=378, w=378: picture(seed, min(h, 379), min(w, 379))) if small else picture
    )


QUESTION = "What is the total revenue shown for the third quarter of the year in this chart?"
JSON_ANSWER = {  # the constrained row's grammar: a long string keeps every row running
    "type": "json_schema",
    "json_schema": {"name": "note", "schema": {
        "type": "object", "required": ["note"], "additionalProperties": False,
        "properties": {"note": {"type": "string", "minLength": 40, "maxLength": 60}}}},
}  # fmt: skip


def counted(fn, sites: bool) -> tuple[LaunchCounter, object]:
    with LaunchCounter(sites=sites) as c:
        out = fn()
    return c, out


@contextlib.contextmanager
def torch_forms():
    """The torch forms of the fused ops for a row's setup (not counted), then the Triton ones."""
    before = fused.get_fused_backend()
    fused.set_fused_backend("torch")
    try:
        yield
    finally:
        fused.set_fused_backend(before)


def decode_rows(
    batch: int, settings: dict, sites: bool, family: str = "md2", layers: int = 24,
    small: bool = False, shape: dict | None = None,
) -> dict:  # fmt: skip
    """One decode step of ``batch`` running rows, counted; ``shape``: every row's
    ``response_format`` (a grammar's mask in the step)."""
    _rt, _executor, sched, factory = build(max(batch, 1), family, layers, small)
    image = pictures(small)(1)
    futures = [submit(sched, factory, image, f"{QUESTION} {i}", settings, shape)
               for i in range(batch)]  # fmt: skip
    with torch_forms():
        while sched.waiting or len(sched.running) < batch:
            sched.step()
        sched.step()  # warm: every row decoding
    sched.step()
    # the graph sets count the launches of each body they run uncaptured (``graph_body``)
    with LaunchCounter(sites=sites) as c:
        sched.step_decode()
    running = len(sched.running)
    for f in futures:
        f.cancel()
    return {
        "rows": running,
        "graph_body": c.graph_body,
        "outside": c.launches - c.graph_body,
        "syncs": c.syncs,
        "deferred": c.deferred_reads,
        "uploads_blocking": c.uploads_blocking,
        "uploads_nonblocking": c.uploads_nonblocking,
        "replays": c.replays,
        "sites": c.sites,
    }


def readbacks(c: LaunchCounter) -> int:
    """The reads of the chosen tokens (one ends every prefill: its first token for the skill;
    counted with the syncs, as the host waits for them), from a counter that kept its sites."""
    return sum(n for (kind, _site), n in c.sites.items() if kind == "sync readback")


def forward_syncs(c: LaunchCounter) -> int:
    """Host synchronisations inside the forward: every sync but the token reads."""
    return c.syncs - readbacks(c)


def prefill_rows(family: str = "md2", layers: int = 24, small: bool = False) -> dict:
    """The miss and hit prefill counts (sites always kept: ``readbacks`` reads them), and
    for Moondream 2 the vision encoder's and the crops'."""
    sites, pic = True, pictures(small)
    rt, _executor, sched, factory = build(4, family, layers, small)
    out = {}
    with torch.inference_mode():  # the image size seen before (a new one: ``crops_new_size``)
        rt.crops.pixels(pic(9)).encoder_input(rt.dtype, rt.device)
    with LaunchCounter(sites=sites) as c:  # the graph bodies: ``graph_body`` and ``replays``
        submit(sched, factory, pic(2), QUESTION, GREEDY)
        sched.step_prefill()
    out["prefill_miss"] = c
    before = {id(r) for r in sched.running}
    with LaunchCounter(sites=sites) as c:
        submit(sched, factory, pic(2), "How many bars are there?", GREEDY)
        sched.step_prefill()
    out["prefill_hit"] = c
    state = next(r for r in sched.running if id(r) not in before).handle
    out["hit_positions"] = state.prompt_length - state.reused_page_count
    if family == "md2":  # the vision tower and crops are the same in both families
        out.update(vision_rows(rt, sites, small))
    return out


def vision_rows(rt: MoondreamRuntime, sites: bool, small: bool = False) -> dict:
    out, pic = {}, pictures(small)
    img = pic(3)
    with torch.inference_mode(), LaunchCounter(sites=sites) as c:
        rt.encode_image(img)
    out["vision_9"] = c
    for key, seed in (("crops_new_size", 4), ("crops_seen_size", 5)):  # 757 x 1513, 9 crops
        with torch.inference_mode(), LaunchCounter(sites=sites) as c:
            rt.crops.pixels(pic(seed, 757, 1513)).encoder_input(rt.dtype, rt.device)
        out[key] = c
    return out


def eager(c: LaunchCounter) -> int:
    """Launches outside any graph, each graph launch counted as one."""
    return c.launches - c.graph_body + c.replays
