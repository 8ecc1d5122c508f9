"""Moondream 3 golden checks beyond the shared ones: routing (router logits and chosen experts),
the tau factors and the activation primitives. Runs on the fixtures that have a MoE section.

Routing near ties (the fixture's ``near_ties``: k-th minus (k+1)-th router logit below 1e-3, close
to float32 noise) may be taken either way by an independent implementation; a flip changes that
position's later K/V and router rows a lot and the logits hardly at all. So router logits are
compared with those positions excluded, and the chosen expert sets must be identical everywhere
else.
"""

from __future__ import annotations

import pytest
import torch

from kestrel.moondream.moe import (
    expert_activation,
    tau_factors,
    tau_feature,
    tau_position,
    tau_token_logits,
)
from kestrel.moondream.text import dense_activation
from tests.conformance.cases import run_case
from tests.conformance.golden import assert_close, fixture_params, load_golden

SESSION = {"scope": "session"}


def _moe(meta: dict) -> bool:
    return bool(meta["config"]["text"].get("moe"))


FIXTURES = [p for p in fixture_params() if _moe(load_golden(p.values[0]).meta)]
IMAGES = fixture_params(lambda m: [(im["name"], im) for im in m["images"]] if _moe(m) else [])
CASES = fixture_params(lambda m: [(c["id"], c) for c in m["cases"]] if _moe(m) else [])


class Recorder:
    """A routing sink: per MoE layer, the routing of every forward in call order."""

    def __init__(self) -> None:
        self.logits: dict[int, list[torch.Tensor]] = {}
        self.experts: dict[int, list[torch.Tensor]] = {}

    def __call__(self, layer: int, routing) -> None:
        self.logits.setdefault(layer, []).append(routing.logits.detach().float().cpu())
        self.experts.setdefault(layer, []).append(routing.experts.detach().cpu())


def _check_routing(logits, experts, ref_logits, ref_ids, ties: set[int], golden, what: str):
    """Rows outside ``ties``: logits within the router_logits tolerance, same expert sets."""
    n = ref_logits.shape[0]
    assert logits.shape[0] == n, f"{what}: {logits.shape[0]} routed rows, reference {n}"
    keep = torch.tensor([i not in ties for i in range(n)])
    atol, rtol = golden.tol("router_logits")
    assert_close(logits[keep], ref_logits[keep], atol, rtol, what, "router_logits")
    mine = torch.sort(experts[keep], dim=-1).values
    ref = torch.sort(ref_ids[keep].long(), dim=-1).values
    bad = (mine != ref).any(-1).nonzero().flatten().tolist()
    assert not bad, f"{what}: experts differ outside the near ties at kept rows {bad[:5]}"


@pytest.mark.parametrize(("fx", "im"), IMAGES, **SESSION)
def test_image_routing(fx, im, golden, fp32):
    """Router logits and chosen experts of every BOS + image position in every MoE layer."""
    rec = Recorder()
    fp32.eager.routing_sink = rec
    try:
        fp32.eager.encode_embeddings(fp32.vision(im["name"]).img_emb, tuple(im["tiling"]))
    finally:
        fp32.eager.routing_sink = None
    T, names = golden.tensors, im["tensors"]
    # a near tie in one layer moves that position's rows in the later layers too
    all_ties = {t["position"] for t in im["routing"]["near_ties"]}
    layers = [
        int(k[len("router.L") :]) for k in names if k.startswith("router.L") and "." not in k[7:]
    ]
    assert sorted(rec.logits) == sorted(layers)
    for layer in rec.logits:
        (logits,), (experts,) = rec.logits[layer], rec.experts[layer]
        _check_routing(logits, experts, T[names[f"router.L{layer}"]],
                       T[names[f"router.L{layer}.topk_ids"]], all_ties, golden,
                       f"router.L{layer}[{im['name']}]")  # fmt: skip
        margins = T[names[f"router.L{layer}.kth_margin"]]
        top = torch.topk(logits, experts.shape[1] + 1, dim=-1).values
        mine = top[:, -2] - top[:, -1]
        keep = torch.tensor([i not in all_ties for i in range(len(margins))])
        atol, rtol = golden.tol("router_logits")
        assert_close(mine[keep], margins[keep], 2 * atol, rtol,
                     f"router.kth_margin[{im['name']}]", "router_logits")  # fmt: skip


def _golden_rows(golden, case, prefix: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    T, names = golden.tensors, case["tensors"]
    logits = torch.cat([T[names[f"{prefix}router.prefill.L{layer}"]],
                        T[names[f"{prefix}router.decode.L{layer}"]]])  # fmt: skip
    phase = case["routing"] if not prefix else case["answer"]["routing"]
    ids = [*phase["prefill"][f"L{layer}"]["topk_ids"], *phase["decode"][f"L{layer}"]["topk_ids"]]
    return logits, torch.tensor(ids)


@pytest.mark.parametrize(("fx", "case"), CASES, **SESSION)
def test_case_routing(fx, case, golden, fp32):
    """Router rows of the prompt's prefill and of every decode forward, while the decisions agree
    (the shared suite checks those); the answer phase of a reasoning case from its own rows."""
    out = run_case(fp32, case)  # memoized: decisions are checked in test_golden.py
    rec = Recorder()
    fp32.runs.pop(case["id"])
    fp32.eager.routing_sink = rec
    try:
        run_case(fp32, case)
    finally:
        fp32.eager.routing_sink = None
    assert fp32.runs[case["id"]].prompt_ids == out.prompt_ids
    n_prompt = len(case["prompt_ids"]) - (1 if case.get("image") else 0)  # BOS is in the image
    for layer in rec.logits:
        logits = torch.cat(rec.logits[layer])
        experts = torch.cat(rec.experts[layer])
        ref_logits, ref_ids = _golden_rows(golden, case, "", layer)
        if "answer" in case and "answer.router.prefill.L1" in case["tensors"]:
            ref_logits, ref_ids = _split_reasoning(case, golden, layer, ref_logits, ref_ids)
        n = min(len(logits), len(ref_logits))
        assert n >= n_prompt + 1, f"{case['id']}: only {n} routed rows"
        ties = {t["row"] for t in case["routing"]["near_ties"]}
        _check_routing(logits[:n], experts[:n], ref_logits[:n], ref_ids[:n], ties, golden,
                       f"router.L{layer}[{case['id']}]")  # fmt: skip


def _split_reasoning(case, golden, layer, logits, ids):
    """Reasoning then answer rows, in the order our eager runs them (reasoning decode forwards,
    the answer marker, the answer's decode forwards)."""
    a_logits, a_ids = _golden_rows(golden, case, "answer.", layer)
    return torch.cat([logits, a_logits]), torch.cat([ids, a_ids])


@pytest.mark.parametrize("fx", FIXTURES, **SESSION)
def test_tau_factors(fx, golden, fp32):
    """Layer-1 tau of query_shapes: token logits, position factor, q / v factors and the scaled
    q and v, from the recorded qkv input (prefill and first decode step)."""
    case = next(c for c in golden.meta["cases"] if "tau.prefill.qkv" in c["tensors"])
    T, names = golden.tensors, case["tensors"]
    layer = golden.meta["tau"]["layer"]
    w = fp32.model.text.blocks[layer].tau
    cfg = fp32.model.config.text
    atol, rtol = golden.tol("tau")
    start = case["start_pos"]
    for part in ("prefill", "step0"):
        qkv = T[names[f"tau.{part}.qkv"]][None]  # [1, S, qkv_dim]
        S = qkv.shape[1]
        first = start if part == "prefill" else start + len(case["prompt_ids"]) - 1
        positions = torch.arange(first, first + S)[None]
        q_lin, v_lin = tau_token_logits(qkv, w)
        tau_q, tau_v = tau_factors(qkv, positions, w)
        tau_pos = tau_position(positions, w, qkv.dtype)
        H, D = cfg.n_heads, cfg.head_dim
        q = qkv[0, :, : H * D].view(S, H, D) * tau_q[0, :, :, None]
        v = qkv[0, :, 2 * H * D :].view(S, H, D) * tau_v[0, :, :, None]
        got = {"tok_q_lin": q_lin[0], "tok_v_lin": v_lin[0], "tau_pos": tau_pos[0].T,
               "tau_q": tau_q[0].T, "tau_v": tau_v[0].T, "q_scaled": q.transpose(0, 1),
               "v_scaled": v.transpose(0, 1)}  # fmt: skip
        for key, val in got.items():
            assert_close(val, T[names[f"tau.{part}.{key}"]], atol, rtol,
                         f"tau.{part}.{key}[{case['id']}]", "tau")  # fmt: skip


@pytest.mark.parametrize("fx", FIXTURES, **SESSION)
def test_activation_primitives(fx, golden):
    ap, T = golden.meta["activation_primitives"], golden.tensors
    atol, rtol = golden.tol("activation_primitives")
    x = torch.tensor(ap["x"])
    hg = torch.tensor(ap["expert_hg"])
    got = {
        "tau_feature": tau_feature(x),
        "dense_activation": dense_activation(x),
        "expert_activation": expert_activation(hg[:, 0], hg[:, 1]),
    }
    for key, val in got.items():
        assert_close(val, T[f"primitives.{key}"], atol, rtol, key, "activation_primitives")
