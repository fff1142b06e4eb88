"""``conceptdict eval`` under torchrun (api/eval_ranks.py, saes/lazy_ranks.py): each rank reads only its own range of
a block artifact's latents, and eval.json is the one-process lazy evaluation's.

Two torchrun launches (gloo; startup dominates): 2 processes (the stored 2 files, one per rank) and 3 (ranges cut
across the files), each evaluating a topk, jumprelu, crosscoder, clt and clt-batchtopk block artifact through
``cd.evaluate`` (2 ranks: also a topk spliced into a tiny causal LM) and then ``conceptdict eval`` on the command
line. The refusals and the ranges are tested in one process, over a seam that only says which rank this is.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from test_distributed_shards import blocks_of
from test_distributed_train import failure, torchrun

pytestmark = pytest.mark.equivalence  # N ranks = 1 process: `make test` runs these again under another ATen capability
D, L, K, S = 12, 96, 4, 3
"""A one-space dictionary of 96 latents; a CLT of 3 layers of 32 latents each; both saved in 2 files."""
HOOKPOINTS = {"topk": ["a"], "jumprelu": ["a"], "crosscoder": ["a", "b"],
              "clt": [f"in{l}" for l in range(S)] + [f"out{l}" for l in range(S)]}
HOOKPOINTS["clt-batchtopk"] = HOOKPOINTS["clt"]
KINDS = list(HOOKPOINTS)
TOLERANCE = 1e-5
"""Relative: the ranks' partial decodes are summed in another order than one process's blocks."""


def _artifact(kind: str, where: Path, store: Path, seed: int, d: int = D, hookpoints: list[str] | None = None) -> Path:
    """A ``kind`` dictionary with every weight random (thresholds positive; a CLT's decoder its triangle), saved as a
    block artifact of 2 files as a 2-shard run writes it."""
    from conceptdict.saes import SparseCoder
    from conceptdict.saes.artifact import finish_parts, save_dictionary_part

    torch.manual_seed(seed)
    sources = S if kind.startswith("clt") else 2 if kind == "crosscoder" else 1
    whole = SparseCoder(d, L, K, kind, n_sources=sources)
    state = whole.state_dict()
    for name, t in state.items():
        t.copy_(torch.rand_like(t) * 0.3 + 0.1 if name in ("threshold", "norm_scale") else torch.randn_like(t))
    whole.load_state_dict(state)
    parts = blocks_of(whole.requires_grad_(False), 2)
    for i, part in enumerate(parts):
        save_dictionary_part(part, where, i, 2)
    return finish_parts(parts[0], where, 2, extra={"stores": [str(store)], "hookpoints": hookpoints or HOOKPOINTS[kind]})


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_lm_store) -> tuple[Path, dict[str, Path]]:
    """(folder, {kind: block artifact}) over one store of 300 rows of every hookpoint, and ("spliced") a topk
    artifact over the tiny causal LM's token store (its CE loss recovered and KL score measured)."""
    from conceptdict.activations import import_array
    from conceptdict.activations.importer import ImportConfig
    from safetensors.torch import save_file

    tmp = tmp_path_factory.mktemp("eval_ranks")
    names = sorted({h for hs in HOOKPOINTS.values() for h in hs})
    rows = torch.randn(300, len(names), D, generator=torch.Generator().manual_seed(5)) * 2
    save_file({h: rows[:, i].contiguous() for i, h in enumerate(names)}, str(tmp / "acts.safetensors"))
    store = import_array(ImportConfig(array=tmp / "acts.safetensors", out=tmp / "store"))
    dicts = {kind: _artifact(kind, tmp / kind, store, seed) for seed, kind in enumerate(KINDS)}
    dicts["spliced"] = _artifact("topk", tmp / "spliced", tiny_lm_store[0], 9, 32, ["blocks.1.hook_out"])
    return tmp, dicts


def _settings(out: Path, kind: str = "") -> dict:
    return {"rows_from": "start", "contexts": 4 if kind == "spliced" else 0, "batch_size": 128, "out": str(out)}


@pytest.fixture(scope="module")
def ranked(artifacts) -> dict[int, Path]:
    """{processes: folder} of the eval.json files and per-rank reads of the 2- and 3-process launches."""
    tmp, dicts = artifacts
    done = {}
    for n in (2, 3):
        out = tmp / f"ranks{n}"
        out.mkdir()
        jobs = [{"dictionary": str(d), "settings": _settings(out / f"{kind}.json", kind), "reads": str(out / kind)}
                for kind, d in dicts.items() if kind != "spliced" or n == 2]
        argv = ["eval", str(dicts["topk"])]
        for key, value in _settings(out / "cli.json").items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        proc = torchrun("eval", {"jobs": jobs, "argv": argv}, out, nproc=n)
        assert proc.returncode == 0, failure(proc)
        (out / "stdout.txt").write_text(proc.stdout)
        done[n] = out
    return done


def _leaves(a, b, path: str = "") -> list[tuple[str, float, float]]:
    """Every pair of numbers at the same place in two JSON values (their other leaves asserted equal)."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        return [p for k in a for p in _leaves(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list):
        assert len(a) == len(b), path
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _leaves(x, y, f"{path}[{i}]")]
    if isinstance(a, float) or isinstance(b, float):
        return [(path, float(a), float(b))]
    assert a == b, (path, a, b)
    return []


def _worst(got: dict, want: dict) -> tuple[float, str]:
    """The largest relative difference of two eval.json files (their settings aside), and where."""
    pairs = _leaves({k: v for k, v in got.items() if k != "config"}, {k: v for k, v in want.items() if k != "config"})
    worst = [(0.0 if x == y or (math.isnan(x) and math.isnan(y)) else abs(x - y) / max(abs(x), abs(y), 1e-30), p)
             for p, x, y in pairs]
    return max(worst)


@pytest.mark.integration
@pytest.mark.parametrize("n, kind", [(n, kind) for n in (2, 3) for kind in KINDS] + [(2, "spliced")])
def test_eval_on_ranks_writes_the_one_process_eval_json(artifacts, ranked, monkeypatch, kind, n):
    """eval.json of N ranks, each holding 1/N of the latents, equals the one-process lazy evaluation's within 1e-5
    relative in every number (a topk over a causal LM's store: its spliced losses too) (measured: 0 on 2 ranks, <= 7.2e-8 on 3), L0 and every latent's firing density exactly."""
    import conceptdict as cd
    from conceptdict.saes.lazy import LAZY_ENV

    tmp, dicts = artifacts
    monkeypatch.setenv(LAZY_ENV, "1")
    one = cd.evaluate(dicts[kind], **_settings(tmp / f"one-{kind}.json", kind))
    got = json.loads((ranked[n] / f"{kind}.json").read_text())
    want = json.loads(one.path.read_text())
    worst, where = _worst(got, want)
    print(f"{kind} on {n} ranks: {worst:.3g} relative at {where}")
    assert worst <= TOLERANCE, f"{n} ranks differ from one process by {worst:.3g} relative at {where}"
    assert got["metrics"]["density"] == want["metrics"]["density"] and got["metrics"]["l0"] == want["metrics"]["l0"]
    if kind == "spliced":  # every rank ran the language model, the dictionary's output the ranks' summed one
        assert want["metrics"]["kl_score"] is not None and 0 < want["metrics"]["splice"]["kl_replaced"]
    if kind == "crosscoder":
        assert got["latent_tags"] == want["latent_tags"] and sum(got["latent_tags"].values()) > 0


@pytest.mark.integration
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_reads_only_its_own_range(ranked, kind, n):
    """The ranks' ranges split the latents (a CLT's: each layer's) into N contiguous pieces; each rank read blocks
    within its own range alone, and over the ranks every latent was read."""
    span = L // S if kind.startswith("clt") else L
    reads = [json.loads((ranked[n] / f"{kind}.rank{r}").read_text()) for r in range(n)]
    assert [tuple(r["part"]) for r in reads] == [(i * span // n, (i + 1) * span // n) for i in range(n)]
    covered = []
    for r in reads:
        lo, hi = r["part"]
        assert r["read_ranges"] and all(lo <= a < b <= hi for _, a, b in r["read_ranges"]), r
        covered += [(a, b) for _, a, b in r["read_ranges"]]
    assert min(covered)[0] == 0 and max(b for _, b in covered) == span
    if n == 3:  # rank 1's range crosses the files' boundary (the middle): read as two blocks, one from each
        assert len(reads[1]["read_ranges"]) == 2


@pytest.mark.integration
def test_the_command_line_prints_and_writes_on_rank_zero_only(ranked):
    """``torchrun ... conceptdict eval`` prints its table once and writes one eval.json (the other ranks nothing)."""
    for out in ranked.values():
        stdout = (out / "stdout.txt").read_text()
        assert sum(ln.startswith("eval: ") for ln in stdout.splitlines()) == 1, stdout
        assert json.loads((out / "cli.json").read_text())["metrics"]["n_tokens"] == 300
        assert json.loads((out / "cli.json").read_text())["metrics"] == json.loads((out / "topk.json").read_text())[
            "metrics"]


class _Rank:
    """The seam of rank ``rank`` of ``size`` as far as splitting goes (no collective is called in these tests)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    @property
    def shards(self) -> _Rank:
        return self



@pytest.mark.unit
@pytest.mark.parametrize("n, parts", [(2, [(0, 48), (48, 96)]), (4, [(0, 24), (24, 48), (48, 72), (72, 96)]),
                                      (3, [(0, 32), (32, 64), (64, 96)])])
def test_ranges_follow_the_stored_files_where_they_can_and_cut_them_where_not(artifacts, n, parts):
    """With the stored 2 files, 2 ranks hold a file each and 4 ranks half a file each; 3 ranks' middle range is read
    from both files. Its blocks lie within its range; a block outside it is refused naming the rank."""
    from conceptdict.saes.lazy import open_lazy

    _, dicts = artifacts
    for r, (lo, hi) in enumerate(parts):
        lazy = open_lazy(dicts["topk"], block_latents=16, comm=_Rank(r, n))
        assert lazy.part == (lo, hi) and lazy.blocks[0][0] == lo and lazy.blocks[-1][1] == hi
        assert all(b - a > K and (a < 48) == (b <= 48) for a, b in lazy.blocks), "a block within one file"
    last = re.escape(f"[{lo}, {hi})")  # the last rank's
    with pytest.raises(ValueError, match=rf"must lie in {last} \(rank {n - 1} of {n}'s\)"):
        lazy.latents(0, 16)
    with pytest.raises(ValueError, match=rf"reads every latent .* rank {n - 1} of {n} holds only latents {last}: run"):
        lazy.decoder_directions()
    clt = open_lazy(dicts["clt"], comm=_Rank(1, 3))
    assert clt.part == (10, 21) and clt.blocks == [(10, 16), (16, 21)]  # each layer's 32 latents, 16 per file


@pytest.mark.unit
def test_a_first_piece_of_k_latents_or_fewer_joins_the_next(artifacts):
    """A rank's range that starts k latents or fewer before a file's end reads that piece with the next one."""
    from conceptdict.saes.lazy import file_pieces

    assert file_pieces([(None, 45, 48), (None, 48, 72)], 100, K) == [(45, 72)]
    assert file_pieces([(None, 40, 48), (None, 48, 72)], 100, K) == [(40, 48), (48, 72)]


@pytest.mark.unit
def test_too_many_ranks_for_the_latents_is_refused_with_the_most_that_fit(artifacts):
    from conceptdict.saes.lazy import open_lazy

    _, dicts = artifacts
    with pytest.raises(ValueError, match=r"20 ranks split the 96 latents .* into ranges of 4, not more than k=4: "
                                         r"run on at most 19 processes"):
        open_lazy(dicts["topk"], comm=_Rank(0, 20))


@pytest.mark.unit
def test_what_eval_does_not_split_over_ranks_is_refused_with_its_fix(artifacts, tmp_path):
    """A kind whose rule reads other latents, --metrics, a set of per-layer transcoders, a dictionary in memory or in
    another layout, and a CLT's replacement-model scores: each refused before anything is read, naming the fix."""
    from conceptdict.eval_ranks import refuse, refuse_run
    from conceptdict.saes import SparseCoder, save_dictionary
    from conceptdict.settings import ConfigError

    _, dicts = artifacts
    two = _Rank(0, 2)
    matryoshka = save_dictionary(SparseCoder(D, L, K, "matryoshka"), tmp_path / "m")
    with pytest.raises(ConfigError, match=r"a matryoshka dictionary is not split over ranks .* run `conceptdict eval` "
                                          r"in one process \(without torchrun\)"):
        refuse(matryoshka, [], [], two)
    with pytest.raises(ConfigError, match=r"--metrics core: under torchrun eval measures its own table only"):
        refuse(dicts["topk"], [], ["core"], two)
    with pytest.raises(ConfigError, match=r"a set of 2 per-layer transcoders; .* evaluate each layer's folder"):
        refuse(tmp_path, [tmp_path / "0", tmp_path / "1"], [], two)
    with pytest.raises(ConfigError, match=r"pass a local folder in conceptdict's layout"):
        refuse(SparseCoder(D, L, K, "topk"), [], [], two)
    refuse(dicts["topk"], [], [], two)  # what it splits passes

    class Run:
        source, where = None, "DICT"
        dictionary = SparseCoder(D, L, K, "clt", n_sources=S)

    with pytest.raises(ConfigError, match=r"DICT: a clt split over ranks is not spliced .* pass --contexts 0"):
        refuse_run(Run(), True)
    refuse_run(Run(), False)
    Run.dictionary = SparseCoder(D, L, K, "topk")
    refuse_run(Run(), True)  # a one-space dictionary is spliced on every rank
