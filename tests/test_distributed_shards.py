"""Latent-sharded training (``latent_shards``): 2 and 4 gloo ranks each holding a slice of the latents, and 2 shards x
2 data ranks, train the dictionary one process trains (to float32 rounding of float64 runs, as the data-parallel test); a checkpoint written
by 2 shards resumes on 4 and back on 2 to the uninterrupted result; the final dictionary is one ordinary artifact.

Two torchrun launches (startup dominates): 2 processes (every kind on 2 shards; a 2-shard run killed after its
step-6 checkpoint), then 4 processes (every kind on 4 shards and on 2 x 2; the killed run resumed on 4 shards and
killed again after a step-9 checkpoint; that resumed on 2 shards x 2 data ranks to the end).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_distributed_train import KINDS as EVERY_KIND
from test_distributed_train import (GOES_BACK, base_config, failure, max_diff, noise_stores, one_process, ulps,
                                    one_process_held_apart, synthetic_store, torchrun)

from conceptdict.saes import reads_several_sources, train, train_config

KINDS = ["topk", "batchtopk", "jumprelu", "relu", "crosscoder", "clt", "clt-batchtopk"]
LAYOUTS = {"2": (2, 2), "4": (4, 4), "2x2": (2, 4)}
"""name -> (latent shards, processes)."""
SEVERAL = ("2", "2x2")
"""The layouts whose runs save one weights file per shard (``single_file_gib=0``); 4 shards gather onto the writer."""

pytestmark = pytest.mark.equivalence  # `make test` runs these again under another ATen CPU capability


def hookpoints(kind: str) -> list[str]:
    """A cross-layer transcoder over two layers (inputs a, c; outputs b, d); a crosscoder over a and b."""
    return ["a", "c", "b", "d"] if kind.startswith("clt") else ["a", "b"] if reads_several_sources(kind) else ["a"]


def state(model) -> dict:
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shards")
    store = synthetic_store(tmp)
    refs = {kind: state(one_process(store, hookpoints(kind), train_config(**base_config(kind)), out=tmp / f"{kind}-1"))
            for kind in KINDS}
    launches: dict[int, list[dict]] = {2: [], 4: []}
    for name, (shards, nproc) in LAYOUTS.items():
        for kind in KINDS:
            several = {"single_file_gib": 0} if name in SEVERAL else {}
            launches[nproc].append({"config": base_config(kind, latent_shards=shards, **several),
                                    "stores": [str(store)], "hookpoints": hookpoints(kind),
                                    "weights": str(tmp / f"{kind}-{name}.safetensors"), "out": str(tmp / f"{kind}-{name}")})
    clip = base_config("topk", grad_clip=0.05)  # the clipping is active at every step (the norm counts every shard)
    refs["clipped"] = state(one_process(store, ["a"], train_config(**clip)))
    launches[2].append({"config": {**clip, "latent_shards": 2}, "stores": [str(store)], "hookpoints": ["a"],
                        "weights": str(tmp / "clipped.safetensors")})
    stop = base_config("batchtopk", tokens=128 * 40, stop_patience=2, stop_every=3, stop_threshold=0.05)
    refs["stopping"] = state(one_process(store, ["a"], train_config(**stop), out=tmp / "stop-1"))
    launches[2].append({"config": {**stop, "latent_shards": 2}, "stores": [str(store)], "hookpoints": ["a"],
                        "out": str(tmp / "stop-2"), "weights": str(tmp / "stopping.safetensors")})
    noise, held = noise_stores(tmp)
    back = base_config("topk", **GOES_BACK)
    refs["back"] = state(one_process_held_apart(noise, held, train_config(**back), out=tmp / "back-1"))
    launches[2].append({"config": {**back, "latent_shards": 2}, "stores": [str(noise)], "held_out": [str(held)],
                        "hookpoints": ["a"], "out": str(tmp / "back-2"), "weights": str(tmp / "back.safetensors")})
    launches[2].append({"sweep": [base_config("topk", latent_shards=2, single_file_gib=0),  # one pass, two dictionaries
                                  base_config("batchtopk", latent_shards=2)], "stores": [str(store)],
                        "hookpoints": ["a"], "outs": [str(tmp / "sweep-topk"), str(tmp / "sweep-batchtopk")]})
    out = tmp / "resharded"
    cfg = base_config("batchtopk", checkpoint_every=6)
    one = {"stores": [str(store)], "hookpoints": ["a"], "out": str(out), "weights": str(tmp / "never.safetensors")}
    launches[2].append({**one, "config": {**cfg, "latent_shards": 2}, "interrupt_at": 11})  # checkpoint: step 6
    launches[4].append({**one, "config": {**cfg, "latent_shards": 4, "checkpoint_every": 3}, "resume": True,
                        "interrupt_at": 14})  # resumed from step 6 on 4 shards; checkpoint at step 9, killed at 10
    launches[4].append({**one, "config": {**cfg, "latent_shards": 2}, "resume": True,
                        "weights": str(tmp / "resharded.safetensors")})  # 2 shards x 2 data ranks, to the end
    out = tmp / "resharded-clt"  # a CLT's checkpoint: each layer's latents resharded
    cfg = base_config("clt-batchtopk", checkpoint_every=6)
    one = {"stores": [str(store)], "hookpoints": hookpoints("clt"), "out": str(out),
           "weights": str(tmp / "never.safetensors")}
    launches[2].append({**one, "config": {**cfg, "latent_shards": 2}, "interrupt_at": 11})
    launches[4].append({**one, "config": {**cfg, "latent_shards": 4}, "resume": True,
                        "weights": str(tmp / "resharded-clt.safetensors")})
    for kind, hps in EVERY_KIND:  # 4 data ranks, no latent shards: every trainable kind (a CLT over 2 layers)
        hps = hookpoints(kind) if kind.startswith("clt") else hps
        refs.setdefault(kind, state(one_process(store, hps, train_config(**base_config(kind)))))
        launches[4].append({"config": base_config(kind), "stores": [str(store)], "hookpoints": hps,
                            "weights": str(tmp / f"{kind}-dp4.safetensors")})
    for nproc, runs in launches.items():
        proc = torchrun(f"shards{nproc}", {"runs": runs}, tmp, nproc=nproc)
        assert proc.returncode == 0, failure(proc)
    return tmp, refs, store


@pytest.mark.integration
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", KINDS)
def test_latent_shards_train_the_one_process_dictionary(sharded_runs, kind, layout):
    tmp, refs, _ = sharded_runs
    path = tmp / f"{kind}-{layout}.safetensors"
    got = load_file(path)
    assert got["W_dec"].shape[0] == 64, "the shards joined (tests/distributed_entry.py) are not the whole dictionary"
    for r in range(1, LAYOUTS[layout][1]):
        assert max_diff(got, load_file(f"{path}.rank{r}")) == 0.0, f"{kind} on {layout}: rank {r} holds another"
    diff = ulps(got, refs[kind])
    assert diff <= 1, f"{kind} on {layout} latent shards: weights differ from 1 process by {diff:.3g} float32 units"


@pytest.mark.integration
@pytest.mark.parametrize("kind", [k for k, _ in EVERY_KIND])
def test_four_data_ranks_train_the_one_process_dictionary(sharded_runs, kind):
    tmp, refs, _ = sharded_runs
    path = tmp / f"{kind}-dp4.safetensors"
    got = load_file(path)
    for r in range(1, 4):
        assert max_diff(got, load_file(f"{path}.rank{r}")) == 0.0, f"{kind} on 4 data ranks: rank {r} holds another"
    diff = ulps(got, refs[kind])
    assert diff <= 1, f"{kind} on 4 data ranks: weights differ from 1 process by {diff:.3g} float32 units"


@pytest.mark.integration
@pytest.mark.parametrize("kind", KINDS)
def test_sharded_runs_report_the_one_process_metrics(sharded_runs, kind):
    """The logged loss, FVU, L0, AuxK and dead share of the last step sum each shard's part of its latents (the L0,
    the penalties, the dead counters) as one process counts them."""
    tmp, _, _ = sharded_runs
    one, two = (json.loads((tmp / f"{kind}-{n}" / "config.json").read_text())["training"]["last_step"] for n in (1, 2))
    for key in ("loss", "fvu", "l0", "aux", "dead"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), f"{kind}: {key} {two[key]} vs {one[key]}"


SUMMARY_KEYS = ("n_tokens", "fvu", "mse", "l0", "cos_sim", "l2_ratio", "rel_recon_bias", "explained_variance_saebench",
                "dead_fraction", "dense_fraction", "n_latents")


@pytest.mark.integration
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", KINDS)
def test_the_sharded_artifact_and_its_summary_are_one_process(sharded_runs, kind, layout):
    """The end of a sharded run calibrates, evaluates and saves on the shards: 2 shards and 2 x 2 save one file per
    shard (``single_file_gib=0``), 4 shards gather onto the one writer; ``cd.load`` reads the one-process dictionary
    (to float32 rounding: :func:`ulps`), and the end-of-run summary (calibrated threshold, held-out FVU, L0, dead share, ...) matches."""
    import conceptdict as cd
    from conceptdict.saes.artifact import INDEX_FILE, disk_tensors, part_file

    tmp, _, _ = sharded_runs
    out, n = tmp / f"{kind}-{layout}", LAYOUTS[layout][0]
    want = [INDEX_FILE, *(part_file(i, n) for i in range(n))] if layout in SEVERAL else ["weights.safetensors"]
    assert sorted(p.name for p in out.glob("weights*")) == sorted(want)
    one, got = cd.load(tmp / f"{kind}-1"), cd.load(out)
    assert got.n_latents == 64
    diff = ulps(disk_tensors(got), disk_tensors(one))
    assert diff <= 1, f"{kind} on {layout}: the saved dictionary differs from 1 process by {diff:.3g} float32 units"
    a, b = one.config["training"], got.config["training"]
    for key in SUMMARY_KEYS:
        assert b["heldout_eval"][key] == pytest.approx(a["heldout_eval"][key], rel=1e-4, abs=1e-6), \
            f"{kind} on {layout}: held-out {key} {b['heldout_eval'][key]} vs {a['heldout_eval'][key]}"
    assert b["heldout_eval"]["density_histogram"] == a["heldout_eval"]["density_histogram"]
    assert ("threshold" in a) == ("threshold" in b)
    for key, value in a.get("threshold", {}).items():
        if isinstance(value, (float, list)):  # a CLT's per_layer: one threshold per layer, in float32 matmuls
            assert b["threshold"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), f"{kind}: threshold {key}"
        else:
            assert b["threshold"][key] == value, f"{kind}: threshold {key}"


@pytest.mark.integration
def test_a_sweep_trains_sharded_dictionaries_in_one_pass(sharded_runs):
    """``train_sweep`` with latent shards: topk (one file per shard) and batchtopk (gathered onto the writer) on one
    pass over the batches end as each alone in one process."""
    import conceptdict as cd
    from conceptdict.saes.artifact import disk_tensors

    tmp, _, _ = sharded_runs
    for kind in ("topk", "batchtopk"):
        diff = ulps(disk_tensors(cd.load(tmp / f"sweep-{kind}")), disk_tensors(cd.load(tmp / f"{kind}-1")))
        assert diff <= 1, f"{kind} in a sharded sweep differs from 1 process by {diff:.3g} float32 units"
    assert (tmp / "sweep-topk" / "weights.index.json").exists()
    assert (tmp / "sweep-batchtopk" / "weights.safetensors").exists()


@pytest.mark.integration
def test_a_missing_shard_file_of_a_run_is_named(sharded_runs, tmp_path):
    import shutil

    import conceptdict as cd

    tmp, _, store = sharded_runs
    copy = tmp_path / "topk"
    shutil.copytree(tmp / "topk-2", copy)
    (copy / "weights-00001-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="weights-00001-of-00002.safetensors is missing"):
        cd.load(copy)
    with pytest.raises(ValueError, match="weights-00001-of-00002.safetensors is missing"):
        cd.evaluate(copy, store=str(store), hookpoint="a")


@pytest.mark.integration
def test_gradient_clipping_takes_the_norm_over_every_shard(sharded_runs):
    tmp, refs, _ = sharded_runs
    diff = ulps(load_file(tmp / "clipped.safetensors"), refs["clipped"])
    assert diff <= 1, f"clipped 2-shard run differs from 1 process by {diff:.3g} float32 units"


@pytest.mark.integration
def test_two_shards_stop_where_one_process_stops(sharded_runs):
    """The stopping rule's held-out FVU goes through the sharded forward: 2 shards stop at one process's step, and
    on a run that memorises go back to the same step's weights."""
    tmp, refs, _ = sharded_runs
    one, two = (json.loads((tmp / d / "config.json").read_text())["training"] for d in ("stop-1", "stop-2"))
    assert one["stopping"]["fired_at"] is not None and one["steps"] < 40
    assert (two["steps"], two["stopping"]["fired_at"]) == (one["steps"], one["stopping"]["fired_at"])
    assert ulps(load_file(tmp / "stopping.safetensors"), refs["stopping"]) <= 1
    one, two = (json.loads((tmp / d / "config.json").read_text())["training"]["stopping"] for d in ("back-1", "back-2"))
    assert one["back_to"] is not None and (two["back_to"], two["end_step"]) == (one["back_to"], one["end_step"])
    assert ulps(load_file(tmp / "back.safetensors"), refs["back"]) <= 1  # each shard went back to its part


@pytest.mark.integration
def test_checkpoint_reshards_from_two_to_four_and_back(sharded_runs):
    tmp, refs, _ = sharded_runs
    diff = ulps(load_file(tmp / "resharded.safetensors"), refs["batchtopk"])
    assert diff <= 1, f"2 -> 4 -> 2 shard resume differs from the uninterrupted run by {diff:.3g} float32 units"
    out = tmp / "resharded"
    names = sorted(p.name for p in out.glob("checkpoint*.pt"))
    assert names == ["checkpoint.shard-0-of-2.pt", "checkpoint.shard-1-of-2.pt"], names
    parts = [torch.load(out / n, weights_only=True) for n in names]
    assert [p["step"] for p in parts] == [14, 14] and parts[0]["model"]["W_dec"].shape[0] == 32
    diff = ulps(load_file(tmp / "resharded-clt.safetensors"), refs["clt-batchtopk"])
    assert diff <= 1, f"a clt-batchtopk resumed from 2 shards on 4 differs from one process by {diff:.3g} units"


@pytest.mark.integration
def test_sharded_checkpoint_resumes_in_one_process(sharded_runs, tmp_path):
    """The shard files join into one checkpoint: one process resumes the 2-shard run's last checkpoint (step 14)
    and reads the same dictionary; the artifact the sharded run saved is an ordinary one (``cd.load``)."""
    import conceptdict as cd

    tmp, refs, store = sharded_runs
    out = tmp / "resharded"
    loaded = cd.load(out)
    assert loaded.n_latents == 64 and ulps(state(loaded), refs["batchtopk"]) <= 1
    assert loaded.config["training"]["steps"] == 14
    cfg = train_config(**base_config("batchtopk", checkpoint_every=6))
    model = one_process(store, ["a"], cfg, out=out, resume=True)
    assert ulps(state(model), refs["batchtopk"]) <= 1
    assert sorted(p.name for p in out.glob("checkpoint*.pt")) == ["checkpoint.pt"]


@pytest.mark.unit
def test_kinds_that_cannot_be_sharded_refuse(tmp_path):
    with pytest.raises(ValueError, match="kind 'matryoshka' cannot be trained with latent_shards=2; the kinds that "
                                         "can: batchtopk"):
        train_config(kind="matryoshka", latents=64, k=4, latent_shards=2)
    with pytest.raises(ValueError, match="latent_shards=3 must .* divide latents=64"):
        train_config(latents=64, k=4, latent_shards=3)
    with pytest.raises(ValueError, match="latent_shards=2 but the seam holds 1 latent shard"):
        train(train_config(latents=64, k=4, latent_shards=2), [torch.randn(32, 8)] * 4)
    from conceptdict.saes.kinds import check_shards  # a CLT's shards split each layer's latents

    with pytest.raises(ValueError, match="latent_shards=4 must divide the 32 latents per layer of this 2-layer clt "
                                         "into shards of more than k=8 latents each; pick latents a multiple of 8 "
                                         "above 64"):
        check_shards("clt", 64, 8, 4, layers=2)
    with pytest.raises(ValueError, match="the 30 latents per layer"):
        check_shards("clt-batchtopk", 60, 2, 4, layers=2)
    check_shards("clt", 64, 7, 4, layers=2)


@pytest.mark.integration
def test_the_command_line_trains_sharded_and_every_command_reads_the_artifact(sharded_runs, tmp_path, capsys):
    """``torchrun --nproc_per_node=2 conceptdict train --latent-shards 2`` writes the dictionary one process writes
    (the flag reaches the run through TrainConfig), an ordinary artifact that ``eval``, ``export`` (SAELens) and
    ``cd.load`` read unchanged."""
    import conceptdict as cd
    from conceptdict.cli.main import main
    from test_distributed_cli import _cli

    _, _, store = sharded_runs
    args = ["train", "--store", str(store), "--hookpoint", "a", "--kind", "topk", "--latents", "64", "--k", "4",
            "--batch-size", "128", "--tokens", "1280", "--seed", "2", "--device", "cpu", "--precision", "float64"]
    weights = {}
    for n, extra in ((1, []), (2, ["--latent-shards", "2"])):
        out = tmp_path / f"sae{n}"
        proc = _cli([*args, *extra, "--out", str(out)], n, tmp_path, capsys)
        assert proc.returncode == 0, failure(proc)
        assert "dictionary: D=12, L=64, k=4" in proc.stdout, "the summary names the whole dictionary, not a shard"
        if n == 2:  # rank 1 says nothing but errors (each log line without its time, once)
            said = [ln.split(" ", 1)[-1] for ln in proc.stderr.splitlines() if " INFO " in ln or " WARNING " in ln]
            assert said and len(said) == len(set(said)), f"a line said once per rank: {said}"
        weights[n] = load_file(out / "weights.safetensors")
    assert ulps(weights[1], weights[2]) <= 1
    sharded = tmp_path / "sae2"
    assert sorted(p.name for p in sharded.glob("checkpoint*")) == ["checkpoint.shard-0-of-2.pt",
                                                                   "checkpoint.shard-1-of-2.pt"]
    assert cd.load(sharded).n_latents == 64
    one, two = (cd.evaluate(tmp_path / f"sae{n}", store=str(store)) for n in (1, 2))
    assert two.metrics.fvu == pytest.approx(one.metrics.fvu, abs=1e-4)
    assert two.metrics.l0 == pytest.approx(one.metrics.l0, abs=1e-3)
    assert main(["export", str(sharded), "--format", "saelens", "--out", str(tmp_path / "saelens")]) == 0
    assert cd.load(tmp_path / "saelens").n_latents == 64
    several = sharded_runs[0] / "topk-2"  # a 2-shard run saved one file per shard
    files = cd.evaluate(several, store=str(store), hookpoint="a", out=tmp_path / "files.json")
    whole = cd.evaluate(sharded_runs[0] / "topk-1", store=str(store), hookpoint="a", out=tmp_path / "whole.json")
    assert files.metrics.fvu == pytest.approx(whole.metrics.fvu, abs=1e-4)
    assert main(["export", str(several), "--format", "saelens", "--out", str(tmp_path / "saelens-files")]) == 0
    assert cd.load(tmp_path / "saelens-files").n_latents == 64


@pytest.mark.unit
@pytest.mark.parametrize("d, latents, shards", [(5, 132, 4), (12, 64, 2), (96, 2048, 4)])
def test_shards_draw_the_one_process_initialisation_block_by_block(d, latents, shards):
    """Each shard draws the whole dictionary's random start a block of rows at a time (never the whole [L, D]) and
    keeps its rows: together they are the one-process draw, tails under torch's 16-value fill included."""
    from conceptdict.saes.model import SparseCoder, _draw_blocks

    one = SparseCoder(d, latents, 2)
    one.reset_parameters(torch.Generator().manual_seed(7))
    parts = []
    for i in range(shards):
        part = SparseCoder(d, latents // shards, 2)
        part.reset_parameters(torch.Generator().manual_seed(7), shard=(i, shards))
        parts.append(part.W_dec.detach())
    assert torch.equal(torch.cat(parts), one.W_dec.detach())
    g = torch.Generator().manual_seed(7)
    whole = torch.randn((latents, d), generator=g)
    g = torch.Generator().manual_seed(7)
    blocks = [torch.randn((e - s, d), generator=g) for s, e in _draw_blocks(latents, d, elements=256)]
    assert len(blocks) > 1 and torch.equal(torch.cat(blocks), whole)


@pytest.mark.unit
@pytest.mark.parametrize("layers, shards", [(2, 2), (3, 4)])
def test_clt_shards_draw_the_one_process_initialisation_of_each_layer(layers, shards):
    """A CLT's shard i holds the i-th slice of every layer's latents (saes.latents): its rows of the one-process
    draw, so that the shards joined layer by layer are the one-process dictionary, encoder and decoder blocks."""
    from conceptdict.saes.latents import join
    from conceptdict.saes.model import SparseCoder

    one = SparseCoder(5, 16 * layers, 2, "clt", n_sources=layers)
    one.reset_parameters(torch.Generator().manual_seed(7))
    parts = []
    for i in range(shards):
        part = SparseCoder(5, 16 * layers // shards, 2, "clt", n_sources=layers)
        part.reset_parameters(torch.Generator().manual_seed(7), shard=(i, shards))
        parts.append(part)
    assert torch.equal(join([p.W_dec for p in parts], 0, layers), one.W_dec)
    assert torch.equal(join([p.W_enc for p in parts], 1, layers), one.W_enc)
    for layer in range(layers):  # a decoder block: one layer's latents, one group
        block = f"W_dec_{layer}"
        assert torch.equal(join([getattr(p, block) for p in parts], 0, 1), getattr(one, block))


def blocks_of(whole, parts: int) -> list:
    """``whole`` cut into ``parts`` latent blocks, each a SparseCoder of its latents (as latent shards hold them)."""
    from conceptdict.saes.latents import cut, latent_groups
    from conceptdict.saes.model import SparseCoder

    n = whole.n_latents // parts
    out = []
    for i in range(parts):
        part = SparseCoder(whole.d_in, n, whole.k, whole.kind, n_sources=whole.n_sources)
        part.load_state_dict({name: t if whole.latent_axis(name) is None else
                              cut([t], whole.latent_axis(name), latent_groups(whole, name), i, parts)
                              for name, t in whole.state_dict().items()})
        part.training_summary = {"steps": 3}
        out.append(part)
    return out


@pytest.mark.unit
@pytest.mark.parametrize("kind, sources", [("topk", 1), ("batchtopk", 1), ("jumprelu", 1), ("crosscoder", 2),
                                          ("clt", 2), ("clt-batchtopk", 2)])
def test_a_dictionary_saved_in_latent_blocks_loads_as_one(tmp_path, kind, sources):
    """Each latent block written as its own weights-0000I-of-0000N.safetensors plus weights.index.json: ``cd.load``
    (every command's loader) reads the one dictionary, bit for bit; a single file saved there later replaces them."""
    import conceptdict as cd
    from conceptdict.saes import evaluate
    from conceptdict.saes.artifact import (
        INDEX_FILE,
        disk_tensors,
        finish_parts,
        save_dictionary,
        save_dictionary_part,
    )
    from conceptdict.saes.model import SparseCoder

    torch.manual_seed(0)
    whole = SparseCoder(6, 64, 4, kind, n_sources=sources)  # a CLT: 2 layers, each file a slice of both
    whole.load_state_dict({name: torch.rand_like(t) + 0.1 if t.dim() == 1 and t.numel() in (64, sources) else
                           torch.randn_like(t) for name, t in whole.state_dict().items()})
    blocks = blocks_of(whole, 4)
    for i, part in enumerate(blocks):
        save_dictionary_part(part, tmp_path, i, 4)
    finish_parts(blocks[0], tmp_path, 4, extra={"hookpoints": ["a"]})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["config.json", INDEX_FILE,
                            *(f"weights-0000{i}-of-00004.safetensors" for i in range(1, 5))])
    loaded = cd.load(tmp_path)
    assert loaded.n_latents == 64 and loaded.config["hookpoints"] == ["a"]
    assert loaded.config["training"]["steps"] == 3
    saved = disk_tensors(loaded)
    for name, t in disk_tensors(whole).items():  # what the format saves of it
        assert torch.equal(saved[name], t), f"{kind}: {name} differs after the blocks are joined"
    x = torch.randn(32, 2 * sources if kind.startswith("clt") else sources, 6) if sources > 1 else torch.randn(32, 6)
    assert evaluate(loaded, [x]).fvu == evaluate(whole, [x]).fvu
    save_dictionary(whole, tmp_path)  # the ordinary artifact over the blocks: they go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "weights.safetensors"]
    assert torch.equal(cd.load(tmp_path).W_dec, whole.W_dec)


@pytest.mark.unit
def test_a_missing_latent_block_file_is_named(tmp_path):
    from conceptdict.saes import FormatError, load_dictionary
    from conceptdict.saes.artifact import finish_parts, save_dictionary_part
    from conceptdict.saes.model import SparseCoder

    blocks = blocks_of(SparseCoder(6, 64, 4, "topk"), 2)
    for i, part in enumerate(blocks):
        save_dictionary_part(part, tmp_path, i, 2)
    finish_parts(blocks[0], tmp_path, 2)
    (tmp_path / "weights-00002-of-00002.safetensors").unlink()
    with pytest.raises(FormatError, match=r"weights-00002-of-00002.safetensors is missing: .* saved in 2 files "
                                          r"\(weights.index.json names them\).*copy every file the index names"):
        load_dictionary(tmp_path)
