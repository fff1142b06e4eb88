"""Every kernel implementation against the dense reference: values and gradients, float32 and bfloat16.

Codes are compared densely (scattered into [B, L]), so the order of the kept entries and the padding
slots do not matter. bfloat16 encoder tests use inputs whose pre-activations are exact and pairwise
distinct (x = identity, W_enc a permutation of distinct bf16 numbers), so no implementation can pick a
different entry on a tie or a rounding difference; gradients then differ only by summation order.
The triton implementation runs through Triton's interpreter on CPU (skipped when triton is absent).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton_impl

from conceptdict.saes import kernels  # noqa: E402
from conceptdict.saes.kernels import reference, select, sparse  # noqa: E402

pytestmark = pytest.mark.unit

HAS_TRITON = importlib.util.find_spec("triton") is not None
IMPLS = [
    "torch",
    pytest.param("numba", marks=pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="no numba")),
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")),
]
DTYPES = [torch.float32, torch.bfloat16]
# (B, D, L, k): not powers of two, k = 1, k = L, one row
SHAPES = [(37, 19, 53, 5), (11, 11, 23, 1), (6, 6, 7, 7), (1, 5, 9, 3)]


@pytest.fixture(autouse=True)
def _small_row_chunks(monkeypatch):
    """Encode in chunks of 16 rows, so the chunked selection and its joins are exercised at test shapes."""
    monkeypatch.setattr(sparse, "ROW_CHUNK", 16)


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)


def _close(a, b, dtype, what):
    a, b = a.float(), b.float()
    scale = max(1.0, b.abs().max().item())
    tol = _tol(dtype)
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    torch.testing.assert_close(a / scale, b / scale, rtol=tol["rtol"], atol=tol["atol"], msg=lambda m: f"{what}: {m}")


def _dense(values, indices, L):
    """[B, K] codes -> [B, L] float32 (differentiable in values)."""
    return torch.zeros(values.shape[0], L, dtype=torch.float32).scatter_add(1, indices, values.float())


def _encoder_inputs(B, D, L, dtype, seed=0, latent_major=False):
    """float32: random; bfloat16: x = I (D = B) and W_enc a signed permutation of distinct exact values.
    ``latent_major``: W_enc [D, L] as a transposed view of [L, D] storage (SparseCoder's layout)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        x = torch.randn(B, D, generator=g)
        W = torch.randn(D, L, generator=g) / D**0.5
        b = 0.1 * torch.randn(L, generator=g)
    else:
        D = B
        x = torch.eye(B)
        n = B * L
        i = torch.arange(n)
        distinct = (1 + (i % 128).float() / 128) * torch.exp2((i // 128).float() - 6)
        sign = torch.where(torch.rand(n, generator=g) < 0.3, -1.0, 1.0)
        W = (distinct * sign)[torch.randperm(n, generator=g)].view(B, L)
        b = torch.zeros(L)
    if latent_major:
        W = W.t().contiguous().t()
    return [t.to(dtype).requires_grad_() for t in (x, W, b)]


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


# ------------------------------------------------------------------ sparse decode


def _decodes_against_the_reference(impl, dtype, values, indices, W, bias, weight, skip_zero_grads):
    """``impl``'s sparse decode (x_hat, grad values, grad W_dec, grad b_dec) of (values * weight).sum(), each
    checked against the reference's in dtype and value; returns impl's."""
    outs = {}
    for name in ("reference", impl):
        v, Wd, bd = (t.to(dtype).requires_grad_() for t in (values, W, bias))
        out = kernels.sparse_decode(v, indices, Wd, bd, impl=name, skip_zero_grads=skip_zero_grads)
        outs[name] = (out, *_grads((out.float() * weight).sum(), (v, Wd, bd)))
    for what, a, b in zip(("x_hat", "grad values", "grad W_dec", "grad b_dec"), outs[impl], outs["reference"]):
        assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
        _close(a, b, dtype, what)
    return outs[impl]


@pytest.mark.equivalence
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,D,L,K", [(37, 19, 53, 5), (1, 130, 7, 7), (13, 3, 5, 9)])
@pytest.mark.parametrize("skip_zero_grads", [False, True])
def test_sparse_decode(impl, dtype, B, D, L, K, skip_zero_grads):
    g = torch.Generator().manual_seed(B + D)
    indices = torch.randint(0, L, (B, K), generator=g)
    indices[:, -1] = indices[:, 0]  # repeated index in every row
    values = torch.rand(B, K, generator=g)
    values[0, 1:] = 0.0  # a zero-padded row (as BatchTopK produces)
    indices[0, 1:] = 0
    values[-1, K // 2] = 0.0  # a ReLU zero inside a row
    W = torch.randn(L, D, generator=g)
    bias = torch.randn(D, generator=g)
    weight = torch.randn(B, D, generator=g)
    outs = _decodes_against_the_reference(impl, dtype, values, indices, W, bias, weight, skip_zero_grads)
    zero_grads = outs[1][values == 0]
    assert bool((zero_grads == 0).all()) == skip_zero_grads, "zero values: gradient 0 exactly when skipped"


@pytest.mark.equivalence
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,D,L,K", [(37, 19, 53, 5), (13, 3, 5, 9)])
def test_sparse_decode_with_a_mask_skips_only_the_padding(impl, dtype, B, D, L, K):
    """``skip_zero_grads`` as a bool mask (JumpReLU's padded code): the entries where it is False get gradient 0, the
    others their gradient, zero values included (the threshold's estimator reads it); values and gradients equal
    the reference's."""
    g = torch.Generator().manual_seed(B + 3 * D)
    indices = torch.randint(0, L, (B, K), generator=g)
    values = torch.rand(B, K, generator=g)
    keep = torch.ones(B, K, dtype=torch.bool)
    keep[0, 1:] = False  # a padded row
    values[0, 1:], indices[0, 1:] = 0.0, 0
    keep[-1, K // 2 + 1:] = False
    values[-1, K // 2 + 1:] = 0.0
    values[-1, K // 2] = 0.0  # a zero inside the kept entries: it keeps its gradient
    W, bias, weight = torch.randn(L, D, generator=g), torch.randn(D, generator=g), torch.randn(B, D, generator=g)
    grad_v = _decodes_against_the_reference(impl, dtype, values, indices, W, bias, weight, keep)[1]
    assert bool((grad_v[~keep] == 0).all()) and float(grad_v[-1, K // 2]) != 0


# ------------------------------------------------------------------ encoders


def _run_encode(name, x, W, b, k, **kw):
    enc = kernels.encode(x, W, b, k, impl=name, **kw)
    L = W.shape[1]
    g = torch.Generator().manual_seed(7)
    R, R_aux = torch.randn(x.shape[0], L, generator=g), torch.randn(x.shape[0], L, generator=g)
    dense, dense_aux = _dense(enc.values, enc.indices, L), _dense(enc.aux_values, enc.aux_indices, L)
    loss = (dense * R).sum() + (dense_aux * R_aux).sum()
    return enc, dense.detach(), dense_aux.detach(), _grads(loss, (x, W, b))


def _check_encode(impl, dtype, x, W, b, k, **kw):
    ref = _run_encode("reference", x, W, b, k, **kw)
    got = _run_encode(impl, x, W, b, k, **kw)
    assert got[0].values.dtype == dtype and got[0].indices.dtype == torch.int64
    _close(got[1], ref[1], dtype, "code")
    _close(got[2], ref[2], dtype, "aux code")
    _close(got[0].smallest.reshape(()), ref[0].smallest.reshape(()), dtype, "smallest kept")
    for what, a, c in zip(("grad x", "grad W_enc", "grad b_enc"), got[3], ref[3]):
        _close(a, c, dtype, what)
    return got[0]


@pytest.mark.equivalence
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,D,L,k", SHAPES)
@pytest.mark.parametrize("latent_major", [False, True])
def test_encode_topk(impl, dtype, B, D, L, k, latent_major):
    x, W, b = _encoder_inputs(B, D, L, dtype, latent_major=latent_major)
    ref = kernels.encode_topk(x, W, b, k, impl="reference")
    got = kernels.encode_topk(x, W, b, k, impl=impl)
    _close(_dense(got.values, got.indices, L), _dense(ref.values, ref.indices, L), dtype, "topk code")
    _check_encode(impl, dtype, x, W, b, k)


@pytest.mark.equivalence
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,D,L,k", SHAPES)
@pytest.mark.parametrize("ranked", [False, True])
@pytest.mark.parametrize("latent_major", [False, True])
def test_encode_batch_topk(impl, dtype, B, D, L, k, ranked, latent_major):
    x, W, b = _encoder_inputs(B, D, L, dtype, latent_major=latent_major)
    scale = None
    if ranked:  # a crosscoder's ranking weights: powers of two keep bf16 scores exact and distinct
        scale = torch.exp2(torch.randint(0, 3, (L,), generator=torch.Generator().manual_seed(3)).float()).to(dtype)
        if dtype == torch.bfloat16:
            pytest.skip("scaled bf16 scores can tie across latents; covered in float32")
    enc = _check_encode(impl, dtype, x, W, b, k, batch=True, scale=scale)
    kept = enc.values > 0
    assert int(kept.sum()) <= k * B
    assert torch.all(enc.indices[~kept] == 0) and torch.all(enc.values[~kept] == 0), "padding must be (0, 0.0)"


@pytest.mark.equivalence
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_dead", [0, 1, 17])
@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("latent_major", [False, True])
@pytest.mark.parametrize("aux_form", ["auto", "sparse"])
def test_encode_with_aux(impl, dtype, n_dead, batch, latent_major, aux_form, monkeypatch):
    if aux_form == "sparse":
        monkeypatch.setattr(sparse, "DENSE_AUX_FACTOR", 0)
    B, D, L, k, k_aux = 13, 13, 31, 3, 6
    x, W, b = _encoder_inputs(B, D, L, dtype, seed=5, latent_major=latent_major)
    dead = torch.zeros(L, dtype=torch.bool)
    dead[torch.randperm(L, generator=torch.Generator().manual_seed(2))[:n_dead]] = True
    enc = _check_encode(impl, dtype, x, W, b, k, batch=batch, dead=dead, k_aux=k_aux)
    # few dead latents (<= DENSE_AUX_FACTOR * k_aux): a dense code over all of them, indices broadcast
    dense = 0 < n_dead <= sparse.DENSE_AUX_FACTOR * min(k_aux, n_dead)
    assert enc.aux_indices.shape == (B, n_dead if dense else min(k_aux, n_dead))
    assert bool(dead[enc.aux_indices].all())
    assert n_dead == 0 or int((enc.aux_values != 0).sum(dim=1).max()) <= k_aux
    if dense:
        assert enc.aux_indices.stride(0) == 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n_dead", [0, 4])
def test_encode_aux_alone(impl, n_dead):
    B, D, L, k_aux = 9, 9, 20, 3
    x, W, b = _encoder_inputs(B, D, L, torch.float32, seed=1)
    dead = torch.zeros(L, dtype=torch.bool)
    dead[:n_dead] = True
    ref = kernels.encode_aux(x, W, b, dead, k_aux, impl="reference")
    got = kernels.encode_aux(x, W, b, dead, k_aux, impl=impl)
    assert got.values.shape == ref.values.shape == (B, min(n_dead, k_aux))
    _close(_dense(got.values, got.indices, L), _dense(ref.values, ref.indices, L), torch.float32, "aux code")
    if n_dead:
        weight = torch.randn(B, L)
        ga = _grads((_dense(got.values, got.indices, L) * weight).sum(), (x, W, b))
        gr = _grads((_dense(ref.values, ref.indices, L) * weight).sum(), (x, W, b))
        for what, a, c in zip(("grad x", "grad W_enc", "grad b_enc"), ga, gr):
            _close(a, c, torch.float32, what)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scaled", [False, True])
def test_batch_topk_on_acts(impl, scaled):
    B, L, k = 17, 29, 4
    g = torch.Generator().manual_seed(4)
    acts = torch.relu(torch.randn(B, L, generator=g)).requires_grad_()
    scale = torch.rand(L, generator=g) + 0.5 if scaled else None
    weight = torch.randn(B, L, generator=g)
    res = {}
    for name in ("reference", impl):
        code, smallest = kernels.batch_topk(acts, k, scale=scale, impl=name)
        dense = _dense(code.values, code.indices, L)
        res[name] = (dense, smallest, *_grads((dense * weight).sum(), (acts,)))
    for what, a, c in zip(("code", "smallest", "grad acts"), res[impl], res["reference"]):
        _close(a, c, torch.float32, what)


# ------------------------------------------------------------------ selection paths and dispatch


@pytest.mark.parametrize("impl", IMPLS)
def test_row_topk_with_columns(impl):
    if impl == "triton":
        pytest.skip("triton selects with torch.topk")
    mod = {"torch": "torch_impl", "numba": "numba_impl"}[impl]
    backend = __import__(f"conceptdict.saes.kernels.{mod}", fromlist=["BACKEND"]).BACKEND
    g = torch.Generator().manual_seed(9)
    pre, bias, scale = torch.randn(23, 301, generator=g), torch.randn(301, generator=g), torch.rand(301, generator=g)
    cases = [(37, None, None, None), (1, None, None, None), (301, None, None, None), (5, torch.arange(3, 301, 7), None, None),
             (40, None, bias, None), (7, None, bias, scale), (6, torch.arange(0, 301, 3), bias, scale), (1, None, None, scale)]
    for k, cols, b, s in cases:
        values, indices = backend.row_topk(pre, k, cols, b, s)
        score = (pre + (0 if b is None else b)) * (1 if s is None else s)
        sub = score if cols is None else score[:, cols]
        expect = sub.topk(k, dim=1).values
        torch.testing.assert_close(values.sort(dim=1, descending=True).values, expect)
        torch.testing.assert_close(score.gather(1, indices), values)
        if cols is not None:
            assert bool(torch.isin(indices, cols).all())
    # a floor hint (TopK after the first chunk) never changes the answer: rows whose k-th score is
    # below it are scanned again
    score = pre + bias
    kth = score.topk(9, dim=1).values[:, -1]
    for floor in (float(kth.min()) - 1, float(kth.median()), float(kth.max()) + 1):
        values, indices = backend.row_topk(pre, 9, None, bias, None, floor)
        torch.testing.assert_close(values.sort(dim=1, descending=True).values, score.topk(9, dim=1).values)
        torch.testing.assert_close(score.gather(1, indices), values)


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="no numba")
def test_row_above_collects_every_score_above_the_cutoff():
    from conceptdict.saes.kernels import numba_impl

    g = torch.Generator().manual_seed(11)
    pre, bias, scale = torch.randn(19, 203, generator=g), torch.randn(203, generator=g), torch.rand(203, generator=g)
    for tau, cap, b, s in ((1.5, 40, None, None), (0.5, 7, bias, None), (0.2, 300, bias, scale), (9.0, 5, None, scale)):
        score = (pre + (0 if b is None else b)) * (1 if s is None else s)
        values, indices, count = numba_impl.row_above(pre, tau, cap, b, s)
        above = score > tau
        assert torch.equal(count, above.sum(dim=1))
        for r in range(pre.shape[0]):
            cols = torch.nonzero(above[r]).flatten()[:cap]  # the first cap of them, in column order
            n = cols.numel()
            assert torch.equal(indices[r, :n], cols)
            torch.testing.assert_close(values[r, :n], score[r, cols])
            assert bool((values[r, n:] == 0).all()) and bool((indices[r, n:] == 0).all())


@pytest.mark.parametrize("impl", ["torch", "numba"])
def test_latent_major_encoder_grad_keeps_its_layout(impl):
    """With W_enc stored latent-major (SparseCoder's layout) the fast backends return grad W_enc in that
    layout (rows of grad W_enc^T written directly): autograd then keeps it without a transpose copy."""
    if impl == "numba" and importlib.util.find_spec("numba") is None:
        pytest.skip("no numba")
    x, W, b = _encoder_inputs(29, 13, 41, torch.float32, latent_major=True)
    enc = kernels.encode(x, W, b, 4, impl=impl)
    (grad_W,) = torch.autograd.grad((enc.values * torch.randn_like(enc.values)).sum(), (W,))
    assert grad_W.stride() == W.stride() == (1, 13)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hot_rows", [0, 1, 3, 16, 40])
@pytest.mark.parametrize("where", ["first", "last"])
def test_batch_topk_unproven_rows(impl, hot_rows, where):
    """Rows holding more than 4k of the k*B winners cannot be proven by their candidates: they are
    recomputed whole (in select_batch on acts, and from x in the fused encode); the result stays exact.
    With 16-row chunks, hot rows first make the cutoff guessed from the first chunk too high for the
    rest (every later row is recomputed); hot rows last overflow their slots above the cutoff."""
    B, D, L, k = 40, 24, 200, 3
    g = torch.Generator().manual_seed(hot_rows)
    x = torch.randn(B, D, generator=g)
    hot = slice(0, hot_rows) if where == "first" else slice(B - hot_rows, B)
    x[hot] *= 6.0  # these rows own far more than their share of the batch's winners
    W = torch.randn(D, L, generator=g)
    b = torch.zeros(L)
    ref_v, ref_i, ref_s = reference.batch_topk(torch.relu(x @ W + b), k)
    enc = kernels.encode(x, W, b, k, batch=True, impl=impl)
    torch.testing.assert_close(_dense(enc.values, enc.indices, L), _dense(ref_v, ref_i, L))
    torch.testing.assert_close(enc.smallest, ref_s)
    code, smallest = kernels.batch_topk(torch.relu(x @ W + b), k, impl=impl)
    torch.testing.assert_close(_dense(code.values, code.indices, L), _dense(ref_v, ref_i, L))
    if hot_rows:
        assert int((enc.values > 0).sum(dim=1).max()) > select.CANDIDATE_FACTOR * k, "no row was unproven"


def test_auto_is_resolved_at_call_time_and_imports_nothing():
    code = ("import sys, torch; import conceptdict.saes.kernels as k; "
            "assert 'numba' not in sys.modules and 'triton' not in sys.modules, 'imported at package import'; "
            "print(k.resolve_impl('encode', 'auto', torch.device('cpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = "numba" if importlib.util.find_spec("numba") else "torch"
    assert out.stdout.strip() == expected
    assert kernels.resolve_impl("encode", "torch", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="impl='nope'"):
        kernels.resolve_impl("encode", "nope", torch.device("cpu"))


# ------------------------------------------------------------------ real shapes on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [False, True])
def test_real_shapes_on_gpu(batch):
    """triton against torch (same addmm and selection, so the same entries) at the benchmark's shapes, and the
    torch loss against the dense reference (whose separate matmul may round a near-tie the other way)."""
    if not HAS_TRITON:
        pytest.skip("triton not installed")
    B, D, L, k = 4096, 768, 16384, 32
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, D, device="cuda", generator=g).requires_grad_()
    W = (torch.randn(D, L, device="cuda", generator=g) / D**0.5).requires_grad_()
    b = torch.zeros(L, device="cuda").requires_grad_()
    W_dec = torch.randn(L, D, device="cuda", generator=g).requires_grad_()
    b_dec = torch.zeros(D, device="cuda").requires_grad_()
    dead = torch.zeros(L, dtype=torch.bool, device="cuda")
    dead[::10] = True
    res = {}
    for name in ("reference", "torch", "triton"):
        enc = kernels.encode(x, W, b, k, batch=batch, dead=dead, k_aux=D // 2, impl=name)
        x_hat = kernels.sparse_decode(enc.values, enc.indices, W_dec, b_dec, impl=name)
        e_hat = kernels.sparse_decode(enc.aux_values, enc.aux_indices, W_dec, None, impl=name)
        loss = (x - x_hat).pow(2).sum() + (x - e_hat).pow(2).sum()
        res[name] = (loss, x_hat, e_hat, *torch.autograd.grad(loss, (x, W, b, W_dec, b_dec)))
    names = ("loss", "x_hat", "e_hat", "grad x", "grad W_enc", "grad b_enc", "grad W_dec", "grad b_dec")
    for what, a, c in zip(names, res["triton"], res["torch"]):
        _close(a.cpu(), c.cpu(), torch.float32, what)
    torch.testing.assert_close(res["torch"][0], res["reference"][0], rtol=1e-3, atol=0)


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="no numba")
def test_recycled_gradient_buffers_are_never_shared_while_held():
    """numba's [L, D] scatter outputs are reused across calls, but only once no tensor holds them: a
    gradient kept from one step (a parameter's .grad, a view of it, its .data) never changes under a later one."""
    from conceptdict.saes.kernels import numba_impl

    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 41, (30, 4), generator=g)
    val = torch.rand(30, 4, generator=g)
    A = torch.randn(30, 13, generator=g)
    first = numba_impl.scatter_rows(idx, val, A, 41)
    kept = (first.clone(), first.t(), first.data)
    second = numba_impl.scatter_rows(idx, 2 * val, A, 41)
    assert first.data_ptr() != second.data_ptr()
    torch.testing.assert_close(second, 2 * kept[0])
    del first
    third = numba_impl.scatter_rows(idx, 3 * val, A, 41)  # the view and .data still hold the first buffer
    assert third.data_ptr() not in (kept[1].data_ptr(), second.data_ptr())
    torch.testing.assert_close(kept[1].t(), kept[0])
    torch.testing.assert_close(kept[2], kept[0])
    ptrs = {second.data_ptr(), third.data_ptr(), kept[1].data_ptr()}
    del second, third, kept
    assert numba_impl.scatter_rows(idx, val, A, 41).data_ptr() in ptrs, "a free buffer is reused"
    numba_impl.release_buffers()
    assert not numba_impl._RECYCLED

    # in training: the parameter's gradient of one step survives the next backward when it is kept
    W_dec = torch.randn(41, 13, generator=g).requires_grad_()
    codes = [(torch.rand(30, 4, generator=g), torch.randint(0, 41, (30, 4), generator=g)) for _ in range(2)]
    grads = []
    for v, i in codes:
        W_dec.grad = None
        kernels.sparse_decode(v, i, W_dec, None, impl="numba").pow(2).sum().backward()
        grads.append((W_dec.grad, W_dec.grad.clone()))
    for held, copy in grads:
        torch.testing.assert_close(held, copy)


def test_batch_topk_survives_recomputed_rows_that_round_below_the_cut():
    """An unproven row is recomputed by another matmul than its candidates (rows apart, addmm against mm plus the
    bias), which may round its entry at the cut t just below t. The pool of entries >= t then held fewer than k*B,
    and topk raised 'selected index k out of range' (bench/synthetic_recovery.py, k = 3 on the hierarchy setting,
    seed 1, after 100 steps). The unproven rows are then taken whole: the k*B largest entries are kept."""
    full = torch.tensor([[5.0, 3.0, 0.5, 0.2], [4.0, 2.0, 1.0, 0.1], [1.0, 0.5, 0.2, 0.1]])
    # two candidates per row; row 0 overflowed its slots above a guessed cutoff (floor +inf: unproven), and the
    # cut t, the k*B = 3rd largest candidate, is its own entry 3.0
    cand = select.Candidates(full[:, :2].clone(), full[:, :2].clone(), torch.tensor([[0, 1]] * 3),
                             torch.tensor([float("inf"), 2.0, 0.5]))

    def rounding_full_rows(rows):  # the recomputation comes out one part in 1e6 below the candidates
        value = full[rows] * (1 - 1e-6)
        return value, value

    sel = select.batch_from_candidates(cand, 1, 4, rounding_full_rows)
    kept = _dense(sel.values, sel.indices, 4) > 0
    assert kept.nonzero().tolist() == [[0, 0], [0, 1], [1, 0]]



@pytest.mark.equivalence
@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_batch_topk_keeps_every_entry_tied_with_the_cut(impl):
    """Rows repeated in a batch (a causal LM's first position in every context) tie exactly. BatchTopK keeps every
    entry whose score equals the (k*B)-th largest, not some of them: the choice is a function of the scores alone,
    so it is the same whatever the rows' order and however the batch is split over processes (the seam keeps
    ``scores >= cut`` on every rank). Integer-valued inputs make every product and sum exact, so the ties are exact on
    every CPU; one other row with a few large entries shifts the cut into the middle of a group of tied copies."""
    B, D, L, k = 12, 4, 16, 2
    g = torch.Generator().manual_seed(3)
    W = torch.randint(-3, 4, (D, L), generator=g).float()
    x = torch.tensor([1.0, 2.0, 0.0, 1.0]).repeat(B, 1)
    x[-1] = torch.tensor([0.0, 0.0, 9.0, 0.0])
    b = torch.zeros(L)
    acts = torch.relu(x @ W + b)
    cut = acts.flatten().topk(k * B).values.min()
    want = (acts >= cut) & (acts > 0)
    assert int(want.sum()) > k * B, "the cut does not fall inside a group of ties"
    code, smallest = kernels.batch_topk(acts, k, impl=impl)
    assert torch.equal(_dense(code.values, code.indices, L) > 0, want), f"{impl}: kept {int((code.values > 0).sum())}"
    assert float(smallest) == float(cut)
    if impl != "reference":  # the fused encoder of a training step
        enc = kernels.encode(x, W, b, k, batch=True, impl=impl)
        assert torch.equal(_dense(enc.values, enc.indices, L) > 0, want), f"{impl} encode: kept {int((enc.values > 0).sum())}"
        assert float(enc.smallest) == float(cut)
