"""A row that ends -- on its ``max_tokens``-th token or on its stop token -- retires without
feeding that token through another decode forward, on both model families, with and without
decode look-ahead, and its answer, finish reason and metrics equal the eager reference's.

The random-weight fixtures never choose eos in a greedy answer, so each runs here from a copy
whose ``eos_id`` is a token one of the batch's answers emits early (``STOP_IDS``; read off the
fixtures' goldens): that answer stops on it (the skill's stop rule, token == eos_id, unfed) while
the others run to ``max_tokens`` in the same batch. The reference runs on the same copy.

How many decode forwards a row takes (the prefill yields its first token; each forward feeds one
token and yields the decision after it):

* an answer cut at ``max_tokens`` = N: tokens 1 .. N-1 are fed, the N-th ends it unfed: N - 1;
* an answer that stops after n tokens: all n are fed, the forward of the n-th chose the stop
  token: n (with look-ahead, plus at most one queued step that fed the stop token before the
  host had read it; that position is rolled back and never cached).

The tree must only ever hold tokens whose K/V were written: what a release inserts is exactly
the fed tokens (never the unfed last token, never a rolled-back position), and the K/V of the
inserted answer positions equal the reference's."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kestrel import Engine
from kestrel.prefix_cache.lease import CacheLease
from kestrel.reference.eager import EagerMoondream
from kestrel.runtime.sequence import PENDING
from kestrel.tokens import TextToken
from tests.conftest import FIXTURES
from tests.integration.conftest import assert_idle, scheduler_paused
from tests.tolerance import assert_close

# the 4th greedy id of query_shapes (md2) and of query_text_only (md3) in the goldens
STOP_IDS = {"md2-tiny-a": 813, "md3-tiny-a": 702}
REQUESTS = (  # (image, question, max_tokens), one batch, greedy
    ("shapes_378", "What color is the circle?", 8),
    (None, "Tell me about a red car.", 8),
    ("scene_800x600", "How many squares are in the picture?", 4),  # cut while the others run on
    ("tall_300x1000", "Describe the tall image.", 1),  # the prefill's token alone: no forward
)
CUT = 2  # the request cut at max_tokens while look-ahead queues a step for the rest
GREEDY = {"temperature": 0.0}
# the reference's finish reasons, as the API names them
PUBLIC = {"eos": "stop", "max_tokens": "length", "length": "length"}


def stop_fixture(name: str, root: Path) -> Path:
    """A copy of fixture ``name`` whose stop token (``eos_id``) is ``STOP_IDS[name]``."""
    src, out = FIXTURES / name, root / name
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["config"]["tokenizer"]["eos_id"] = STOP_IDS[name]
    (out / "config.json").write_text(json.dumps(config))
    for f in ("model.safetensors", "tokenizer.json"):
        (out / f).symlink_to(src / f)
    return out


def image(images: dict, name: str | None) -> np.ndarray | None:
    return None if name is None else images[name]


def load_images(name: str) -> dict[str, np.ndarray]:
    d = FIXTURES / name / "images"
    return {p.stem: np.asarray(Image.open(p).convert("RGB")) for p in d.glob("*.png")}


@dataclass
class Ledger:
    """What one batch did: the rows started (in submission order), every decode forward and
    the rows it fed, look-ahead positions rolled back, and what each release inserted."""

    started: list = field(default_factory=list)
    forwards: list[tuple[str, list]] = field(default_factory=list)
    rolled_back: Counter = field(default_factory=Counter)
    retained: dict[int, list] = field(default_factory=dict)  # id(lease) -> tokens inserted

    def fed(self, state) -> int:
        """Forwards that fed ``state``'s row (a queued look-ahead step included)."""
        return sum(any(s is state for s in rows) for _, rows in self.forwards)


def watch(engine: Engine, ledger: Ledger, mp: pytest.MonkeyPatch) -> None:
    """Record into ``ledger``; check every invariant after every scheduler step."""
    rt, executor, sched = engine.runtime, engine._executor, engine._scheduler
    for name in ("decode_step", "decode_ahead"):
        real = getattr(rt, name)

        def forward(states, *a, _real=real, _name=name):
            ledger.forwards.append((_name, list(states)))
            return _real(states, *a)

        mp.setattr(rt, name, forward)
    real_settle, real_start, real_step = rt.settle_ahead, executor.start_many, sched.step

    def settle_ahead(state, token, hidden_C):
        ledger.rolled_back[id(state)] += token is None
        return real_settle(state, token, hidden_C)

    def start_many(requests):
        out = real_start(requests)
        ledger.started.extend(getattr(o, "handle", None) for o in out)
        return out

    def step():
        real_step()
        sched.check_integrity()

    real_release = CacheLease.release

    def release(lease, retained=()):
        ledger.retained[id(lease)] = list(retained)
        return real_release(lease, retained)

    mp.setattr(rt, "settle_ahead", settle_ahead)
    mp.setattr(executor, "start_many", start_many)
    mp.setattr(sched, "step", step)
    mp.setattr(CacheLease, "release", release)


def run_batch(model_dir: Path, images: dict, lookahead: bool) -> tuple[list, Ledger, Engine]:
    """The batch of ``REQUESTS`` on a fresh engine (left open: the caller checks and closes)."""
    engine = Engine(
        str(model_dir), device="cpu", dtype="float32", kv_cache_pages=6000, max_batch_size=8,
        lookahead=lookahead,
    )  # fmt: skip
    ledger = Ledger()
    with pytest.MonkeyPatch.context() as mp:
        watch(engine, ledger, mp)
        with scheduler_paused(engine):
            futures = [
                engine.submit_query(image(images, img), q, settings={"max_tokens": n, **GREEDY})
                for img, q, n in REQUESTS
            ]
        results = [f.result(timeout=300) for f in futures]
    return results, ledger, engine


@pytest.fixture(scope="module", params=sorted(STOP_IDS))
def family(request, tmp_path_factory) -> dict:
    """Per fixture: the reference's traces and the batch through the engine, look-ahead off
    and on (run once, checked by every test below)."""
    name = request.param
    model_dir = stop_fixture(name, tmp_path_factory.mktemp("stop"))
    images = load_images(name)
    out: dict = {"name": name, "runs": {}}
    for lookahead in (False, True):
        results, ledger, engine = run_batch(model_dir, images, lookahead)
        out["runs"][lookahead] = (results, ledger, engine)
    engine = out["runs"][False][2]
    eager = EagerMoondream(engine.runtime.model, engine.runtime.tokenizer)
    out["eager"], out["images"] = eager, images
    out["refs"] = [
        eager.query(image(images, img), q, max_tokens=n, temperature=0.0) for img, q, n in REQUESTS
    ]
    yield out
    for _results, _ledger, engine in out["runs"].values():
        assert_idle(engine)
        engine.close()


def expected_fed(result) -> int:
    """Decode forwards that must feed a row (see the module docstring): an answer cut at
    max_tokens leaves its last token unfed; one that stopped fed every token it has."""
    return len(result.tokens) - (result.finish_reason == "length")


def test_answers_and_metrics_match_the_reference(family) -> None:
    """Answer text, ids, finish reason and token counts equal the eager reference's, with
    look-ahead off and on; the metrics that do not time anything are the same both ways."""
    refs = family["refs"]
    reasons = [PUBLIC[r.finish_reason] for r in refs]
    stopped = [i for i, why in enumerate(reasons) if why == "stop"]
    assert stopped and all(len(refs[i].token_ids) < REQUESTS[i][2] for i in stopped), reasons
    assert reasons[CUT] == "length" and len(refs[CUT].token_ids) == REQUESTS[CUT][2], reasons
    seen = {}
    for lookahead, (results, _ledger, engine) in family["runs"].items():
        prefix = engine.config.prefix_len
        for (img, _q, _n), r, ref, why in zip(REQUESTS, results, refs, reasons, strict=True):
            assert (r.answer, r.tokens, r.finish_reason) == (ref.answer, ref.token_ids, why)
            assert r.reasoning is None
            m = r.metrics
            assert (m.output_tokens, m.reasoning_tokens) == (len(ref.token_ids), 0)
            assert m.input_tokens == len(ref.prompt_ids) + (prefix if img else 0)
        seen[lookahead] = [
            (m.input_tokens, m.cached_tokens, m.output_tokens, m.cache_tier, m.reasoning_tokens)
            for m in (r.metrics for r in results)
        ]
    assert seen[True] == seen[False]


@pytest.mark.parametrize("lookahead", [False, True], ids=["plain", "lookahead"])
def test_each_row_is_fed_only_the_tokens_it_keeps(family, lookahead) -> None:
    """Per row: a max_tokens = N answer is fed in exactly N - 1 forwards (never in a queued
    look-ahead step after its last), a stopped one in one per token (plus, with look-ahead, at
    most one queued step fed its stop token, rolled back)."""
    results, ledger, engine = family["runs"][lookahead]
    assert len(ledger.started) == len(REQUESTS) and all(ledger.started)  # one batch
    for (_img, _q, n), r, state in zip(REQUESTS, results, ledger.started, strict=True):
        fed, back = ledger.fed(state), ledger.rolled_back[id(state)]
        assert fed - back == expected_fed(r), (r.tokens, r.finish_reason, fed, back)
        if r.finish_reason == "length":
            assert len(r.tokens) == n and (fed, back) == (n - 1, 0), (fed, back)
        else:
            assert back <= int(lookahead), back
    kinds = {kind for kind, _ in ledger.forwards}
    c = engine._executor.lookahead_counters
    if not lookahead:
        assert kinds == {"decode_step"} and c.steps == 0
        return
    assert c.steps > 0 and c.kept + c.rolled_back == c.rows, c
    # the case under test ran: the cut row's draw was final while the others went on, and the
    # step queued then left it out
    cut = ledger.started[CUT]
    last = max(i for i, (_, rows) in enumerate(ledger.forwards) if any(s is cut for s in rows))
    kind, rows = ledger.forwards[last + 1]
    assert kind == "decode_ahead" and rows and all(s is not cut for s in rows), ledger.forwards


@pytest.mark.parametrize("lookahead", [False, True], ids=["plain", "lookahead"])
def test_the_cache_holds_only_tokens_whose_kv_was_written(family, lookahead) -> None:
    """Each release inserted exactly the fed tokens (not the unfed last one, not a rolled-back
    look-ahead position); the tree continues the prompt through them and no further, and the
    K/V on those pages equal the eager reference's for the same positions."""
    results, ledger, engine = family["runs"][lookahead]
    eager, images = family["eager"], family["images"]
    rt = engine.runtime
    engine.check_integrity()
    for (img, q, n), r, state in zip(REQUESTS, results, ledger.started, strict=True):
        k, lease = expected_fed(r), state.lease
        retained = ledger.retained[id(lease)]
        assert PENDING not in retained and retained == [TextToken(t) for t in r.tokens[:k]]
        query = [*lease.tokens, *(TextToken(t) for t in r.tokens)]
        m = engine._loop.call(
            lambda q=query, ns=lease.namespace: rt.prefix_cache.match_prefix(q, ns)
        )
        assert m.matched_token_count == len(lease.tokens) + k, (m.matched_token_count, k)
        if not k:
            continue
        eager.query(image(images, img), q, max_tokens=n, temperature=0.0)
        assert_same_kv(rt.kv, m.matched_pages, eager.kv, lease.cached_length, k)
    engine.check_integrity()


def assert_same_kv(kv, pages, ref_kv, start: int, k: int) -> None:
    """K and V of positions ``start .. start + k - 1`` on the tree's ``pages`` equal the eager
    reference's (its position p lives in page p + 1). A batched step against a one-row eager
    step: the same sums in another order."""
    pages = torch.as_tensor(pages[start : start + k].astype("int64"))
    for layer in range(len(kv.k)):
        for got, want in ((kv.k[layer], ref_kv.k[layer]), (kv.v[layer], ref_kv.v[layer])):
            assert_close(got[pages], want[1 + start : 1 + start + k], rel=1e-4)


@pytest.mark.parametrize("lookahead", [False, True], ids=["plain", "lookahead"])
def test_a_lone_four_token_answer_is_three_decode_forwards(family, lookahead) -> None:
    """max_tokens = 4, nothing else running, the fixture as published: the prefill chooses token
    1, three forwards feed tokens 1-3 and choose 2-4, token 4 ends the answer unfed."""
    name = family["name"]
    with Engine(
        str(FIXTURES / name), device="cpu", dtype="float32", kv_cache_pages=3000,
        lookahead=lookahead,
    ) as engine:  # fmt: skip
        ledger = Ledger()
        with pytest.MonkeyPatch.context() as mp:
            watch(engine, ledger, mp)
            r = engine.query(None, "Tell me about a red car.", settings={"max_tokens": 4})
        assert (len(r.tokens), r.finish_reason) == (4, "length"), r
        assert [len(rows) for _, rows in ledger.forwards] == [1, 1, 1], ledger.forwards
        assert (engine._executor.lookahead_counters.steps > 0) == lookahead
        assert_idle(engine)
