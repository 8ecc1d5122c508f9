"""Running one golden case through EagerMoondream and checking it (shared by fp32 and bf16)."""

from __future__ import annotations

import torch

from tests.conformance.golden import agreeing_prefix, assert_close
from tests.tolerance import assert_close as assert_near


def run_case(runner, case: dict):
    """The eager result of ``case`` (memoized per runner), with per-step tensors recorded."""
    if case["id"] in runner.runs:
        return runner.runs[case["id"]]
    eg = runner.eager
    adapter = runner.adapter() if case.get("adapter") else None
    image = runner.encoded(case["image"], adapter) if case.get("image") else None
    s = case["settings"]
    kind = case["kind"]
    if kind in ("query", "query_reasoning"):
        out = eg.query(
            image,
            case["question"],
            reasoning=kind == "query_reasoning",
            spatial_refs=case.get("spatial_refs"),
            max_tokens=s["max_tokens"],
            temperature=s["temperature"],
            adapter=adapter,
            record=True,
        )
    elif kind == "caption":
        out = eg.caption(
            image, case["length"], max_tokens=s["max_tokens"], temperature=s["temperature"],
            adapter=adapter, record=True,
        )  # fmt: skip
    elif kind in ("point", "detect"):
        fn = eg.point if kind == "point" else eg.detect
        out = fn(image, case["object"], s["max_objects"], adapter=adapter, record=True)
    else:
        raise AssertionError(f"unknown case kind {kind!r}: update the conformance runner")
    runner.runs[case["id"]] = out
    return out


def check_phase(golden, case, phase, prefix: str, ref_ids, tol_case, *, tokens: bool) -> None:
    """Prefill logits/hidden, then step logits while the decisions agree, then the ids."""
    T = golden.tensors
    names = case["tensors"]
    at, rt = tol_case("logits")
    ah, rh = tol_case("hidden")
    cid = case["id"]
    assert_close(phase.prefill_logits, T[names[f"{prefix}prefill_logits"]], at, rt,
                 f"{prefix}prefill_logits[{cid}]", "logits")  # fmt: skip
    assert_close(phase.prefill_hidden, T[names[f"{prefix}prefill_hidden"]], ah, rh,
                 f"{prefix}prefill_hidden[{cid}]", "hidden")  # fmt: skip
    ref_steps = T[names[f"{prefix}step_logits"]]
    mine = list(phase.token_ids)
    # Row k was produced by feeding tokens 0..k-1: compare it only if those agree.
    n = min(
        agreeing_prefix(mine, list(ref_ids)) + 1, ref_steps.shape[0], phase.step_logits.shape[0]
    )
    assert_close(
        phase.step_logits[:n], ref_steps[:n], at, rt, f"{prefix}step_logits[{cid}]", "logits"
    )
    if tokens:
        assert mine == list(ref_ids), f"{cid}: {prefix}greedy ids {mine} != reference {ref_ids}"


def check_text_case(golden, case, out, tol_case, *, tokens: bool = True) -> None:
    if case["kind"] == "query_reasoning":
        r = out.reasoning
        check_phase(golden, case, r.phase, "", case["greedy_ids"], tol_case, tokens=tokens)
        if list(r.token_ids) != case["greedy_ids"]:
            return  # the answer phase is only comparable after identical reasoning
        ans = case["answer"]
        check_phase(golden, case, out.phase, "answer.", ans["emitted"], tol_case, tokens=tokens)
        if tokens:
            assert r.text == case["reasoning_text"]
            grounding = [
                {
                    "start_idx": g.start_idx,
                    "end_idx": g.end_idx,
                    "points": [list(p) for p in g.points],
                }
                for g in r.grounding
            ]
            assert grounding == case["reasoning_grounding"]
            assert out.answer == case["text"]
        return
    check_phase(golden, case, out.phase, "", case["greedy_ids"], tol_case, tokens=tokens)
    if tokens:
        assert out.answer == case["text"], f"{case['id']}: decoded answer differs"
        assert out.finish_reason == (
            "eos" if case["final_decision"]["reason"] == "eos" else "max_tokens"
        )


def _bins(obj, with_size: bool) -> list[int]:
    return [obj.x_bin, obj.y_bin] + ([obj.w_bin, obj.h_bin] if with_size else [])


def check_region_case(golden, case, out, tol_case, *, decisions: bool = True) -> None:
    """Prefill tensors, then per object x / y / size / next logits while all earlier bins agree."""
    T, names, cid = golden.tensors, case["tensors"], case["id"]
    with_size = case["kind"] == "detect"
    at, rt = tol_case("logits")
    ar, rr = tol_case("region_logits")
    ah, rh = tol_case("hidden")
    assert_close(
        out.prefill_logits, T[names["prefill_logits"]], at, rt, f"prefill_logits[{cid}]", "logits"
    )
    assert_close(
        out.prefill_hidden, T[names["prefill_hidden"]], ah, rh, f"prefill_hidden[{cid}]", "hidden"
    )
    ref_objs = case["objects"]
    keys = ["x_bin", "y_bin"] + (["w_bin", "h_bin"] if with_size else [])
    for k, (mine, step, ref) in enumerate(zip(out.objects, out.steps, ref_objs, strict=False)):
        got, want = _bins(mine, with_size), [ref[key] for key in keys]
        parts = [("x_logits", step.x_logits, 0), ("y_logits", step.y_logits, 1)]
        if with_size:
            parts.append(("size_logits", step.size_logits, 2))
        for name, tensor, n_before in parts:
            if got[:n_before] != want[:n_before]:
                break
            assert_close(
                tensor, T[names[f"obj{k}.{name}"]], ar, rr, f"obj.{name}[{cid}]", "region_logits"
            )
        if got == want:
            ref_next = T[names[f"obj{k}.next_logits"]]
            next_logits = step.next_logits
            if ref_next.shape == (2,):  # Moondream 3 records only the (coord, eos) logits
                tok = golden.meta["config"]["tokenizer"]
                next_logits = next_logits[[tok["coord_id"], tok["eos_id"]]]
            assert_close(next_logits, ref_next, at, rt, f"obj.next_logits[{cid}]", "logits")
        if decisions:
            assert got == want, f"{cid}: object {k} bins {got} != reference {want}"
        elif got != want:
            return
    if not decisions:
        return
    ref_dec = [d["argmax"] for d in case["continue_decisions"]]
    assert list(out.decisions) == ref_dec, f"{cid}: continue decisions differ"
    eos = golden.meta["config"]["tokenizer"]["eos_id"]
    assert [d != eos for d in out.decisions] == [d["continue"] for d in case["continue_decisions"]]
    assert len(out.objects) == len(ref_objs)
    _check_reference_output(case, out, with_size)


def _check_reference_output(case, out, with_size: bool) -> None:
    """The reference's returned values (unclamped); ours are clamped to [0, 1] when reported."""
    for mine, ref in zip(out.objects, case["reference_output"], strict=True):
        if with_size:
            (x, y), (w, h) = mine.center, mine.size
            raw = [x - w / 2, y - h / 2, x + w / 2, y + h / 2]
            want = [ref["x_min"], ref["y_min"], ref["x_max"], ref["y_max"]]
            clamped = [mine.x_min, mine.y_min, mine.x_max, mine.y_max]
        else:
            raw, want = [mine.raw_x, mine.raw_y], [ref["x"], ref["y"]]
            clamped = [mine.x, mine.y]
        assert_near(torch.tensor(raw), torch.tensor(want), rel=1e-6, msg="raw coordinates")
        assert clamped == [min(max(v, 0.0), 1.0) for v in raw]
