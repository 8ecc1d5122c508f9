"""Sampling a whole batch on the device at once (``sampling.sample_rows``, ``heads.batch_rows``).

The draw is inverse-CDF sampling with the caller's uniform number per row; these tests check
it draws from the same distribution as the reference rule (softmax at temperature T, top-p
nucleus, top-k, renormalised), that greedy and sampled rows mix in one call, that suppressed
ids are never chosen, that the batched choice equals the one-row path for the same uniform
number, and that a seeded request's answer does not depend on the rest of its batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from kestrel.moondream.sampling import apply_top_p, sample_rows
from kestrel.runtime.heads import ModelHeads, batch_rows
from kestrel.skills.base import Draw
from kestrel_kernels.counting import LaunchCounter

V = 8
LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0])


def expected(temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """The reference rule, written out: probabilities after truncation and renormalisation."""
    probs = apply_top_p(torch.softmax(LOGITS / temperature, -1)[None], torch.tensor([top_p]))[0]
    if top_k:
        order = torch.argsort(probs, descending=True)
        probs[order[top_k:]] = 0.0
        probs = probs / probs.sum()
    return probs


def frequencies(n: int, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    u = torch.rand(n, generator=g)
    ids = sample_rows(
        LOGITS.expand(n, V), torch.full((n,), temperature), torch.full((n,), top_p),
        torch.full((n,), top_k, dtype=torch.int64), u,
    )  # fmt: skip
    return torch.bincount(ids, minlength=V).float() / n


SETTINGS = [(1.0, 1.0, 0), (0.5, 0.3, 0), (0.7, 0.9, 0), (1.3, 1.0, 3)]


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), SETTINGS)
def test_draws_follow_the_truncated_distribution(temperature, top_p, top_k) -> None:
    n = 40_000
    want, got = expected(temperature, top_p, top_k), frequencies(n, temperature, top_p, top_k)
    assert torch.all(got[want == 0] == 0), "a token outside the nucleus / top-k was drawn"
    # each frequency within 5 standard deviations of a binomial proportion
    sigma = torch.sqrt(want * (1 - want) / n)
    assert torch.all((got - want).abs() <= 5 * sigma + 1e-9), (got, want)
    # and the whole histogram passes a chi-square test (p > 1e-4 for the kept tokens)
    kept = want > 0
    chi2 = float((((got - want)[kept] * n) ** 2 / (want[kept] * n)).sum())
    dof = int(kept.sum()) - 1
    assert dof == 0 or chi2 < dof + 6 * math.sqrt(2 * dof) + 10, chi2


def test_greedy_and_sampled_rows_mix_and_banned_ids_never_win() -> None:
    logits = LOGITS.expand(4, V).clone()
    banned = torch.tensor([[0, -1], [-1, -1], [0, 1], [-1, -1]])
    temp = torch.tensor([0.0, 0.0, 5.0, 5.0])
    for u in torch.linspace(0, 0.999, 50):
        ids = sample_rows(logits, temp, torch.ones(4), torch.zeros(4, dtype=torch.int64),
                          torch.full((4,), float(u)), banned)  # fmt: skip
        assert ids[0] == 1 and ids[1] == 0  # greedy, with and without the argmax banned
        assert ids[2] not in (0, 1)
    every = sample_rows(logits[:1].expand(2000, V), torch.full((2000,), 5.0), torch.ones(2000),
                        torch.zeros(2000, dtype=torch.int64), torch.rand(2000),
                        banned[2:3].expand(2000, 2))  # fmt: skip
    assert not torch.isin(every, torch.tensor([0, 1])).any()


def test_batched_choice_equals_the_one_row_path() -> None:
    """``batch_rows`` with draws chooses what ``ModelHeads.sample`` would for each row alone
    (same uniform number), and reads the batch back in one transfer."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=g) * 3
    draws = [Draw(0.8, 0.9, (), 0.37), None, Draw(0.0, 1.0, (int(logits[2].argmax()),)),
             Draw(1.5, 1.0, (3, 4), 0.91, top_k=5), Draw(0.5, 0.3, (), 0.05),
             Draw(0.0, 1.0)]  # fmt: skip
    with LaunchCounter() as counter:
        rows = batch_rows(logits, draws)
    assert counter.syncs == 1
    heads = ModelHeads.__new__(ModelHeads)
    for i, (row, d) in enumerate(zip(rows, draws, strict=True)):
        # the plain argmax is known where it is the pick: greedy with nothing suppressed
        plain = d is None or (d.temperature == 0 and not d.banned)
        assert row.argmax == (int(logits[i].argmax()) if plain else None)
        if d is None:  # no draw: its argmax, as a greedy decision
            assert row.chosen == row.argmax
            continue
        alone = heads.sample(logits[i], d.temperature, d.top_p, d.banned, None, u=d.u,
                             top_k=d.top_k)  # fmt: skip
        assert row.chosen == alone
        # the skill's own call is answered from the batch (no second transfer)
        with LaunchCounter() as c:
            got = heads.sample(row, d.temperature, d.top_p, d.banned, None, u=d.u, top_k=d.top_k)
        assert got == row.chosen and c.syncs == 0


def test_a_changed_draw_is_not_answered_from_the_batch() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    row, _ = batch_rows(logits, [Draw(0.0, 1.0), Draw(1.0, 1.0, (), 0.5)])
    assert row.chosen == 1
    heads = ModelHeads.__new__(ModelHeads)
    # asked with id 1 banned, which the batch did not know: computed again, not the stale 1
    assert heads.sample(row, 0.0, 1.0, (1,), None) == 2


def test_an_all_greedy_batch_reads_back_only_its_choices() -> None:
    """No sampling ops for a batch of greedy rows; suppressed ids are masked on the device, so
    a row whose argmax its skill suppresses is decided with the batch too. Its plain argmax is
    then unknown: a decision the draw did not announce is computed from its own logits."""
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 1.0, 2.0]])
    with LaunchCounter() as c:
        rows = batch_rows(logits, [Draw(0.0, 1.0, (1,)), Draw(0.0, 1.0)])
    assert c.syncs == 1 and "sort" not in c.by_op
    assert [r.chosen for r in rows] == [2, 0] and [r.argmax for r in rows] == [None, 0]
    heads = ModelHeads.__new__(ModelHeads)
    with LaunchCounter() as c:
        assert heads.sample(rows[0], 0.0, 1.0, (1,), None) == 2
        assert heads.sample(rows[1], 0.0, 1.0, (), None) == 0
    assert c.syncs == 0
    assert heads.sample(rows[0], 0.0, 1.0, (), None) == 1  # unannounced: from the logits


def test_table_rows_greedy_ties_top_k_off_and_u_near_one() -> None:
    """``sample_table``: a greedy row takes the first maximum (ties and near-ties included,
    as torch.argmax does); a row with top-k off keeps its whole nucleus; a uniform number that
    rounds up to 1 in float32 still lands inside the nucleus."""
    from kestrel.moondream.sampling import sample_table, table_row

    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0],  # tie: id 1
            [1.0, 1.0 + 1e-7, 0.5, 1.0],  # near-tie in float32: id 1
            [0.0, 2.0, 2.0, -1.0],  # sampled, top-k off, top-p keeps ids 1 and 2
            [5.0, 0.0, 4.0, 0.0],  # sampled, u -> 1.0 in float32, top-p keeps 0 only
            [9.0, 1.0, 2.0, 3.0],  # greedy, id 0 suppressed
        ]
    )
    width = 1
    rows = [
        table_row(0.0, 1.0, 0, 0.0, (), width),
        table_row(0.0, 1.0, 0, 0.0, (), width),
        table_row(1.0, 0.9, 0, 0.99, (), width),
        table_row(1.0, 0.5, 0, 1.0 - 1e-9, (), width),
        table_row(0.0, 1.0, 0, 0.0, (0,), width),
    ]
    got = sample_table(logits, torch.tensor(rows, dtype=torch.float32)).tolist()
    assert got[:2] == [1, 1] and got[3] == 0 and got[4] == 3
    assert got[2] == 2  # u 0.99 of {1, 2}'s mass: the second kept token (stable order)
