"""BatchTopK's cut and packed code in numba (``numba_impl.batch_pack``, ``numba_batch``) against the torch form
(``select.batch_from_candidates``): the same code bit for bit, on candidates with ties at the cut, unproven rows,
recomputed rows that round below the cut, scaled scores and -0.0; the torch form where a score is NaN; and the fused
encoder's values and gradients with the numba packing equal to those without it over several row chunks."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.unit, pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="no numba")]

from conceptdict.saes.kernels import select, sparse


def _candidates(B, W, L, seed, *, ties=False, scaled=False, unproven=0, rounding=False, density=0.5):
    """Candidates of B rows of L latents as ``row_candidates`` gives them (each row's W best scores in no particular
    order, its floor their smallest), ``unproven`` of the rows cut short with floor +inf (overflowed slots), and the
    whole rows (``full_rows``; recomputed ``rounding`` one part in 1e6 low)."""
    g = torch.Generator().manual_seed(seed)
    score = torch.randint(0, 5, (B, L), generator=g).float() if ties else torch.rand(B, L, generator=g)
    score = torch.where(torch.rand(B, L, generator=g) < 1 - density, torch.zeros(()), score)
    scale = torch.rand(L, generator=g) + 0.5
    value = score / scale if scaled else score.clone()
    top = score.topk(W, dim=1, sorted=False).indices
    top = top.gather(1, torch.argsort(torch.rand(B, W, generator=g), dim=1))  # no order
    cs, cv = score.gather(1, top), value.gather(1, top)
    cs[:4] = torch.where(cs[:4] == 0, -0.0, cs[:4])  # clamped negatives keep their sign: -0.0 among the candidates
    floor = cs.min(dim=1).values
    hot = torch.randperm(B, generator=g)[:unproven]
    score[hot] *= 3.0  # more above the cut than the slots hold
    value[hot] *= 3.0
    cs[hot], cv[hot], floor[hot] = cs[hot] * 3, cv[hot] * 3, float("inf")
    cs[hot, W // 2 :], cv[hot, W // 2 :] = 0.0, 0.0
    filled = torch.full((B,), W)
    filled[hot] = W // 2  # zeros after them
    if density < 0.1:  # rows filled only as far as their positive scores (row_above's rows): the zeros left unread
        order = torch.argsort(cs, dim=1, descending=True, stable=True)
        cs, cv, top = cs.gather(1, order), cv.gather(1, order), top.gather(1, order)
        filled = (cs > 0).sum(dim=1)

    def full_rows(rows):
        f = 1 - 1e-6 if rounding else 1.0
        return score[rows] * f, value[rows] * f

    return select.Candidates(cs, cv if scaled else cs.clone(), top, floor), full_rows, filled


CASES = {
    "plain": {},
    "ties at the cut": {"ties": True},
    "unproven rows": {"unproven": 3},
    "unproven rows, ties": {"unproven": 5, "ties": True},
    "scaled": {"scaled": True, "unproven": 2},
    "recomputed rows round below the cut": {"unproven": 6, "rounding": True},
    "fewer positive entries than k*B: the cut is 0": {"density": 0.02, "unproven": 2},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_pack_is_the_torch_form_bit_for_bit(case, seed):
    from conceptdict.saes.kernels import numba_impl

    B, W, L, k = 48, 12, 64, 3
    cand, full_rows, filled = _candidates(B, W, L, seed, **CASES[case])
    want = select.batch_from_candidates(cand, k, L, full_rows)
    for width in (None, filled):  # every slot read, or each row's filled slots only
        got = numba_impl.batch_pack(cand, k * B, full_rows, width)
        assert got is not None
        values, indices, smallest = got
        assert case != "fewer positive entries than k*B: the cut is 0" or float(smallest) > 0 == float(
            cand.score.flatten().topk(k * B).values.min())
        assert values.dtype == want.values.dtype and indices.dtype == want.indices.dtype
        assert torch.equal(indices, want.indices) and torch.equal(values, want.values), case
        assert torch.equal(smallest, want.smallest)


def test_batch_pack_takes_unproven_rows_whole_when_their_recomputation_rounds_below_the_cut(monkeypatch):
    """``test_kernels.test_batch_topk_survives_recomputed_rows_that_round_below_the_cut``'s candidates: the pool of
    entries >= t holds fewer than k*B, so every entry of the unproven rows joins it (the torch form's rule)."""
    from conceptdict.saes.kernels import numba_batch, numba_impl

    full = torch.tensor([[5.0, 3.0, 0.5, 0.2], [4.0, 2.0, 1.0, 0.1], [1.0, 0.5, 0.2, 0.1]])
    cand = select.Candidates(full[:, :2].clone(), full[:, :2].clone(), torch.tensor([[0, 1]] * 3),
                             torch.tensor([float("inf"), 2.0, 0.5]))

    def rounding_full_rows(rows):
        value = full[rows] * (1 - 1e-6)
        return value, value

    lowers = []
    pick = numba_batch.kth_largest

    def spy(parts, n, high=None):
        lowers.append(parts[-1][-1])
        return pick(parts, n, high)

    monkeypatch.setattr(numba_batch, "kth_largest", spy)
    values, indices, smallest = numba_impl.batch_pack(cand, 3, rounding_full_rows)
    assert lowers[-1] == float("-inf"), "the pool was not widened to the unproven rows' every entry"
    want = select.batch_from_candidates(cand, 1, 4, rounding_full_rows)
    assert torch.equal(values, want.values) and torch.equal(indices, want.indices)
    assert torch.equal(smallest, want.smallest)


def test_batch_pack_hands_a_nan_to_the_torch_form():
    from conceptdict.saes.kernels import numba_impl

    cand, full_rows, _ = _candidates(16, 8, 32, 0)
    cand.score[3, 2] = float("nan")
    assert numba_impl.batch_pack(cand, 2 * 16, full_rows) is None


def test_batch_pack_counts_every_entry_tied_with_the_cut():
    """One value everywhere: the cut is that value, and every entry equal to it is kept (not k*B of them)."""
    from conceptdict.saes.kernels import numba_impl

    B, W = 6, 4
    cand = select.Candidates(torch.ones(B, W), torch.ones(B, W), torch.arange(W).repeat(B, 1), torch.full((B,), 0.5))
    values, indices, smallest = numba_impl.batch_pack(cand, 2 * B, None)  # every row proven: none recomputed
    assert values.shape == (B, W) and bool((values == 1).all()) and float(smallest) == 1.0
    assert torch.equal(indices, select.batch_from_candidates(cand, 2, 9, None).indices)


@pytest.mark.equivalence
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("hot", [0, 4])
def test_encode_with_the_numba_packing_equals_it_without(monkeypatch, scaled, hot):
    """The fused encoder over 16-row chunks (the first chunk's candidates, then ``row_above`` into the buffer) with
    ``batch_pack`` and with the torch form: the same code and smallest, and the same gradients of x, W_enc, b_enc."""
    from conceptdict.saes.kernels import numba_impl

    monkeypatch.setattr(sparse, "ROW_CHUNK", 16)
    B, D, L, k = 72, 16, 96, 3
    g = torch.Generator().manual_seed(hot)
    x = torch.randn(B, D, generator=g)
    x[:hot] *= 5.0  # rows that own more than their slots: recomputed
    W = torch.randn(D, L, generator=g)
    b = torch.randn(L, generator=g) * 0.1
    scale = torch.rand(L, generator=g) + 0.5 if scaled else None
    out = []
    for backend in (numba_impl.BACKEND, numba_impl.BACKEND._replace(batch_pack=None)):
        xs, Ws, bs = (t.clone().requires_grad_() for t in (x, W, b))
        enc = sparse.encode(xs, Ws, bs, k, backend, batch=True, scale=scale)
        (enc.values * torch.linspace(0.5, 1.5, enc.values.numel()).view_as(enc.values)).sum().backward()
        out.append((enc.values.detach(), enc.indices, enc.smallest, xs.grad, Ws.grad, bs.grad))
    for a, b_ in zip(*out):
        assert torch.equal(a, b_)
    if hot:
        assert int((out[0][0] > 0).sum(dim=1).max()) > select.CANDIDATE_FACTOR * k, "no row was unproven"


@pytest.mark.equivalence
def test_the_first_chunks_hint_changes_no_bit(monkeypatch):
    """The first chunk's rows after PROBE_ROWS start their scan at a hint from the probe's floors; rows below it (here
    the quiet ones) are scanned again. The code, smallest and gradients equal those without the hint, and the code the
    dense reference's."""
    from conceptdict.saes.kernels import numba_impl, reference

    B, D, L, k = 700, 24, 256, 4  # one 512-row chunk (64 probed, 448 hinted), then 188 rows above the cutoff
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, D, generator=g) * (torch.rand(B, 1, generator=g) * 2).pow(2)  # heavy-tailed row norms
    W = torch.randn(D, L, generator=g)
    b = torch.randn(L, generator=g) * 0.1
    calls = []
    topk = numba_impl.row_topk

    def spy(pre, k, cols, bias=None, scale=None, floor=float("-inf")):
        calls.append(floor)
        return topk(pre, k, cols, bias, scale, floor)

    out = []
    for probe in (select.PROBE_ROWS, 10**9):
        monkeypatch.setattr(select, "PROBE_ROWS", probe)
        xs, Ws, bs = (t.clone().requires_grad_() for t in (x, W, b))
        enc = sparse.encode(xs, Ws, bs, k, numba_impl.BACKEND._replace(row_topk=spy), batch=True)
        (enc.values * torch.linspace(0.5, 1.5, enc.values.numel()).view_as(enc.values)).sum().backward()
        out.append((enc.values.detach(), enc.indices, enc.smallest, xs.grad, Ws.grad, bs.grad))
    assert calls[1] > 0 and len(calls) == 3, "the hint was not used"
    for a, b_ in zip(*out):
        assert torch.equal(a, b_)
    c_th = torch.relu(x[64:512] @ W + b).topk(select.n_candidates(k, L), dim=1).values[:, -1]
    assert bool((c_th < calls[1]).any()), "no row fell below the hint (none scanned again)"
    ref_v, ref_i, ref_s = reference.batch_topk(torch.relu(x @ W + b), k)
    dense = torch.zeros(B, L).scatter_(1, out[0][1], out[0][0])
    torch.testing.assert_close(dense, torch.zeros(B, L).scatter_(1, ref_i, ref_v))
    torch.testing.assert_close(out[0][2], ref_s)
