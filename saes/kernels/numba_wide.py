"""The sparse passes over a wide code in numba (SpaDE's: ~1,000 entries a row), by latent over parts of D or of B.

The row-ordered kernels of ``numba_kernels`` read a whole row of W (D floats) for every entry of the code, and its
bucketed scatter a whole row of A [B, D] for every entry: with hundreds of entries per latent every row of W (50
MB at L 16384, D 768) and of A (12 MB at B 4096) is read hundreds of times from memory or L3, for a twentieth of
the encoder matmul's arithmetic. Here the entries are bucketed by latent once (:func:`bucket`: a counting sort into
start [L+1], row [N] int32 and value [N] float32, the entries with a nonzero value only) and the passes walk the
buckets in latent order, each over a part of the [B, D] array it reads or writes that stays in the L2:

- :func:`gather_sum`, out [B, D] = bias + S W (the decode; the encoder backward's grad_x = S_g W_enc^T): by blocks of
  :func:`block_rows` whole rows of out (contiguous, in the L2), each thread owning whole blocks (nothing races), the
  rows of W streamed through once a block in latent order;
- :func:`gather_dot`, out [B, K] = <G[b], W[idx]> at the entries (the decode's backward for the values): by the same
  blocks of G's rows, each entry's dot over the whole row of D at once (one horizontal sum an entry);
- :func:`scatter`, out [L, D] = S^T A (the gradients of W_dec and of W_enc^T): by ``tile`` columns of D at a time,
  A's tile packed into a contiguous [B, tile] buffer first, each latent's tile summed in cache and written once.

A bucket's entries are in row order, so a block's entries of a latent are a run of it (found by a binary search).
The sums run in another order than the row-ordered kernels' (by latent, then row): results agree with theirs to
float32 rounding (``tests/test_kernels_wide.py``). ``numba_impl`` takes these kernels for codes with at
least ``WIDE_ENTRIES`` entries per latent on average (SpaDE's), the row-ordered ones otherwise (TopK's).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from .numba_kernels import at_f32

_OPTS = {"parallel": True, "cache": True, "fastmath": True, "nogil": True}

WIDE_ENTRIES = 32
"""Entries per latent (B * K / L) from which the sparse decode and the encoder backward run by latent: SpaDE's code
at the benchmark's shapes has ~240 (measured there: the decode 345 against 490 ms of CPU, a scatter 321 against
866), TopK's 8 (its row kernels stay)."""

def _l2_bytes() -> int:
    """The first CPU's L2 cache in bytes (Linux sysfs), 0 where it cannot be read."""
    from pathlib import Path

    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip().upper()
                return int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]] if size[-1] in "KM" else int(size)
        except (OSError, ValueError):
            return 0
    return 0


PACKED_FLOATS = max(1 << 18, 3 * _l2_bytes() // 16)
"""Floats of one packed tile of the gather-sum and the scatter ([B, tile]): 3/4 of an L2 where it holds more than
1 MiB's floats (the AMX Xeon's 2 MiB: 1.5 MiB, 96 columns at B 4096), else 1 MiB (the AMD EPYC's L2, 64 columns
at B 4096); the tile is the widest multiple of 16 columns that fits, at least 16. (The gather-sum ran over such tiles
until branch i53-spade6: the figures below.) A column's sums do not depend on
the tile (each is its entries' in bucket order), so neither do the results. On the Xeon, one thread, the
benchmark's SpaDE code: tiles of 64 / 96 / 128 columns, gather-sum 297-313 / 272-287 / 265-292 ms, scatter
219-229 / 183-197 / 191-226 (docs/results/speed.md, branch i53-spade5)."""


def tile_width(B: int, D: int) -> int:
    """Columns of D per tile for B rows (:data:`PACKED_FLOATS`)."""
    return max(16, min(D, PACKED_FLOATS // max(B, 1)) // 16 * 16)


ROW_FLOATS = max(1 << 16, 3 * _l2_bytes() // 32)
"""Floats of one block of whole rows of the gather-sum's output and the gather-dot's G ([rows, D]): 3/8 of an L2,
at least 256 KiB (the AMX Xeon's 2 MiB: 768 KiB, 256 rows at D 768). On that Xeon, one thread, the benchmark's SpaDE
code (D 768, L 16384, B 4096, ~1,100 entries a row): blocks of 128 / 192 / 256 / 320 / 384 rows, gather-dot 175 /
169 / 178 / 163 / 173 ms against 276 for the earlier tiles of 96 columns (a dot a tile, eight horizontal sums an
entry), gather-sum of 128 / 256 / 384 / 512 rows 228 / 218 / 214 / 220 against 277 (docs/results/speed.md, branch
i53-spade6)."""


def block_rows(B: int, D: int) -> int:
    """Rows of [B, D] per block of :func:`gather_sum` and :func:`gather_dot` (:data:`ROW_FLOATS`), at least 8."""
    return max(8, min(B, ROW_FLOATS // max(D, 1)))


@njit(cache=True, nogil=True, inline="always")
def _first_at(row, lo, hi, b0):
    """The first position in row[lo:hi] (increasing) whose row is at least b0 (hi where none is)."""
    while lo < hi:
        m = (lo + hi) // 2
        if row[m] < b0:
            lo = m + 1
        else:
            hi = m
    return lo


@njit(**_OPTS)
def _count(idx, val, n_parts, counts):
    """counts[p, r]: the nonzero entries of latent r in part p of the rows (parts: equal ranges of rows, in order)."""
    B, K = idx.shape
    for p in prange(n_parts):
        c = counts[p]
        for b in range(p * B // n_parts, (p + 1) * B // n_parts):
            for j in range(K):
                if val[b, j] != 0.0:
                    c[idx[b, j]] += 1


@njit(**_OPTS)
def _fill(idx, val, n_parts, fill, row, value, entry):
    """Each part writes its entries from its own offsets fill[p, r] on: the parts' rows in order within a latent."""
    B, K = idx.shape
    for p in prange(n_parts):
        f = fill[p]
        for b in range(p * B // n_parts, (p + 1) * B // n_parts):
            for j in range(K):
                v = val[b, j]
                if v != 0.0:
                    r = idx[b, j]
                    t = f[r]
                    row[t] = b
                    value[t] = v
                    entry[t] = b * K + j
                    f[r] = t + 1


def bucket(idx, val, L):
    """Counting sort of the entries of idx / val [B, K] with a nonzero value by latent: (start [L+1] int64, row [N]
    int32, value [N] float32, entry [N] int32: b * K + j), in row order within a latent. Zero entries (padding) add
    nothing to a sum and take no gradient (``skip_zero_grads``). The rows are split between the threads: each
    counts its entries per latent, then writes them from its own offsets."""
    n_parts = max(1, min(numba.get_num_threads(), idx.shape[0]))
    counts = np.zeros((n_parts, L), np.int64)
    _count(idx, val, n_parts, counts)
    start = np.zeros(L + 1, np.int64)
    np.cumsum(counts.sum(axis=0), out=start[1:])
    fill = start[:-1] + np.cumsum(counts, axis=0) - counts  # [n_parts, L]: where part p's entries of r begin
    n = int(start[L])
    row, value, entry = np.empty(n, np.int32), np.empty(n, np.float32), np.empty(n, np.int32)
    _fill(idx, val, n_parts, np.ascontiguousarray(fill), row, value, entry)
    return start, row, value, entry


@njit(**_OPTS)
def gather_sum(start, row, value, W, bias, rows, out):
    """out [B, D] = bias + sum over the entries of value * W[latent] into row ``row``, by blocks of ``rows`` rows
    (each column's sum: its entries in bucket order, whatever the blocks)."""
    B, D = out.shape
    L = W.shape[0]
    for part in prange((B + rows - 1) // rows):
        b0 = part * rows
        b1 = min(B, b0 + rows)
        for b in range(b0, b1):
            o = out[b]
            for d in range(D):
                o[d] = bias[d]
        for r in range(L):
            t, end = start[r], start[r + 1]
            if t == end:
                continue
            t = _first_at(row, t, end, b0)
            if t == end or row[t] >= b1:
                continue
            wr = W[r]
            while t < end and row[t] < b1:
                v = value[t]
                p = out[row[t]]
                for d in range(D):
                    p[d] += v * at_f32(wr, d)
                t += 1


@njit(**dict(_OPTS, fastmath={"contract"}))
def scatter(start, row, value, A, tile, out):
    """out [L, D] = sum over the entries of value * A[row] into the entry's latent, each latent's entries added in
    bucket order (one fused multiply-add each; no reassociation, so eight or four entries a pass over the accumulator
    give the sums one entry a pass gives, in an eighth or a quarter of its loads and stores: 278 -> 241 ms of CPU on
    the benchmark's SpaDE code, one thread, AMX Xeon, with four; eight: 183 -> 170 against four, branch i53-spade6)."""
    B = A.shape[0]
    L, D = out.shape
    for part in prange((D + tile - 1) // tile):
        d0 = part * tile
        w = min(tile, D - d0)
        P = np.empty((B, w), np.float32)
        acc = np.empty(w, np.float32)
        for b in range(B):
            for d in range(w):
                P[b, d] = A[b, d0 + d]
        for r in range(L):
            acc[:] = 0.0
            t, end = start[r], start[r + 1]
            while t + 8 <= end:  # eight entries per pass over acc, added in bucket order as one at a time would
                v0, v1, v2, v3 = value[t], value[t + 1], value[t + 2], value[t + 3]
                v4, v5, v6, v7 = value[t + 4], value[t + 5], value[t + 6], value[t + 7]
                p0, p1, p2, p3 = P[row[t]], P[row[t + 1]], P[row[t + 2]], P[row[t + 3]]
                p4, p5, p6, p7 = P[row[t + 4]], P[row[t + 5]], P[row[t + 6]], P[row[t + 7]]
                for d in range(w):
                    acc[d] = (acc[d] + v0 * p0[d] + v1 * p1[d] + v2 * p2[d] + v3 * p3[d] + v4 * p4[d] + v5 * p5[d]
                              + v6 * p6[d] + v7 * p7[d])
                t += 8
            while t + 4 <= end:  # then four
                v0, v1, v2, v3 = value[t], value[t + 1], value[t + 2], value[t + 3]
                p0, p1, p2, p3 = P[row[t]], P[row[t + 1]], P[row[t + 2]], P[row[t + 3]]
                for d in range(w):
                    acc[d] = acc[d] + v0 * p0[d] + v1 * p1[d] + v2 * p2[d] + v3 * p3[d]
                t += 4
            for u in range(t, end):
                v = value[u]
                p = P[row[u]]
                for d in range(w):
                    acc[d] += v * p[d]
            o = out[r]
            for d in range(w):
                o[d0 + d] = acc[d]


@njit(**_OPTS)
def _dot_block(start, row, entry, G, W, b0, b1, out_flat):
    """out_flat[entry[t]] = <G[row[t]], W[latent]> for the entries t of rows [b0, b1), the latents split between the
    threads. Two entries a pass share the loads of W's row (each dot summed as alone: the same bits): 172-176 -> 151-157
    ms of CPU on the benchmark's SpaDE code, one thread, AMX Xeon."""
    D = G.shape[1]
    L = W.shape[0]
    for r in prange(L):
        t, end = start[r], start[r + 1]
        if t == end:
            continue
        t = _first_at(row, t, end, b0)
        if t == end or row[t] >= b1:
            continue
        wr = W[r]
        while t + 1 < end and row[t + 1] < b1:
            p, q = G[row[t]], G[row[t + 1]]
            s, u = np.float32(0.0), np.float32(0.0)
            for d in range(D):
                w = at_f32(wr, d)
                s += p[d] * w
                u += q[d] * w
            out_flat[entry[t]] = s
            out_flat[entry[t + 1]] = u
            t += 2
        if t < end and row[t] < b1:
            p = G[row[t]]
            s = np.float32(0.0)
            for d in range(D):
                s += p[d] * at_f32(wr, d)
            out_flat[entry[t]] = s


def gather_dot(start, row, entry, G, W, rows, out):
    """out [B, K] = <G[b], W[idx[b, j]]> at the bucketed entries, 0 at the others (zero values: ``skip_zero_grads``).
    By blocks of ``rows`` rows of G (in the L2), the latents of a block split between the threads."""
    B = G.shape[0]
    out[:] = 0.0
    flat = out.reshape(-1)
    for b0 in range(0, B, rows):
        _dot_block(start, row, entry, G, W, b0, min(B, b0 + rows), flat)


@njit(parallel=True, cache=True, nogil=True)  # no fastmath: NaN compares as itself
def count_nonzero(flat):
    """The nonzero entries of the float32 array ``flat`` (numpy's and torch's count), the threads summing parts."""
    n = 0
    for t in prange(flat.shape[0]):
        n += flat[t] != 0.0
    return n


@njit(parallel=True, cache=True, nogil=True)
def take_nonzero(flat, entry, out):
    """out[t] = flat[entry[t]]; returns how many of them are nonzero."""
    n = 0
    for t in prange(entry.shape[0]):
        v = flat[entry[t]]
        out[t] = v
        n += v != 0.0
    return n


@njit(parallel=True, cache=True, nogil=True)  # no fastmath: a NaN value must not compare as positive
def _fired(val, idx, n_parts, fired, count, bad):
    """fired[p, r]: latent r has a positive entry in part p of the rows; count[b]: row b's positive entries; bad[p]:
    part p met a positive entry whose index is outside [0, L)."""
    B, K = idx.shape
    L = fired.shape[1]
    for p in prange(n_parts):
        mine = fired[p]
        for b in range(p * B // n_parts, (p + 1) * B // n_parts):
            c = 0
            for j in range(K):
                if val[b, j] > 0.0:
                    r = idx[b, j]
                    if r < 0 or r >= L:
                        bad[p] = True
                    else:
                        mine[r] = True
                    c += 1
            count[b] = c


def code_fired(val, idx, L):
    """(fired [L] bool: the latents with a positive entry, count [B] int64: each row's positive entries) of the code
    val / idx [B, K], in one pass (the rows split between the threads, each marking its own [L] row)."""
    n_parts = max(1, min(numba.get_num_threads(), idx.shape[0]))
    fired = np.zeros((n_parts, L), np.bool_)
    count = np.empty(idx.shape[0], np.int64)
    bad = np.zeros(n_parts, np.bool_)
    _fired(val, idx, n_parts, fired, count, bad)
    if bad.any():
        raise IndexError(f"a positive entry of the code has an index outside [0, {L}): the code's indices must be "
                         f"latents of a dictionary of {L}")
    return fired.any(axis=0), count
