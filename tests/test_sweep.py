"""Several dictionaries from one pass over the data: each equals its separate run bit for bit, resumes exactly,
and the command line's --sweep trains every combination into its own folder."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file

from conceptdict.saes import TrainConfig, train, train_config
from conceptdict.saes.flat import flat_for_kind
from generators.synthetic import SyntheticSpec, synthetic_batches
from conceptdict.saes.training import train_sweep
from crashing import Crash, crashing

SPEC = SyntheticSpec(n_atoms=48, d=12, active=3, batch_size=64, n_batches=16, seed=3)
DATA = functools.partial(synthetic_batches, SPEC)


def _cfg(**kw):
    base = dict(latents=32, k=3, eval_batches=2, log_every=2, checkpoint_every=3, device="cpu", init_rows=64,
                kernel_impl="reference", threshold_start_step=2)
    return train_config(**flat_for_kind(base | kw, kw.get("kind", "topk")))


# a thresholded kind (holds out 2 more batches, so starts later in the stream), another width, lr and init seed,
# and the kinds with their own trained parameters and hooks (jumprelu, spade) and prefix losses (matryoshka)
CFGS = [_cfg(), _cfg(kind="batchtopk"), _cfg(kind="relu", lr=3e-3), _cfg(latents=48, k=4, seed=5),
        _cfg(kind="jumprelu"), _cfg(kind="matryoshka"), _cfg(kind="spade")]


def _metrics(path):
    return [{k: v for k, v in json.loads(ln).items() if k != "tok_s"} for ln in path.read_text().splitlines()]


def same_run(a, b):
    wa, wb = (load_file(str(p / "weights.safetensors")) for p in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    assert _metrics(a / "metrics.jsonl") == _metrics(b / "metrics.jsonl")
    ca, cb = (json.loads((p / "config.json").read_text())["training"] for p in (a, b))
    assert ca == cb


@pytest.mark.equivalence
@pytest.mark.unit
def test_each_dictionary_of_a_sweep_equals_its_separate_run(tmp_path):
    for i, cfg in enumerate(CFGS):
        train(cfg, DATA, out=tmp_path / "alone" / str(i))
    models = train_sweep(CFGS, DATA, outs=[tmp_path / "sweep" / str(i) for i in range(len(CFGS))],
                         names=[str(i) for i in range(len(CFGS))])
    assert [m.kind for m in models] == [c.kind for c in CFGS]
    for i in range(len(CFGS)):
        same_run(tmp_path / "alone" / str(i), tmp_path / "sweep" / str(i))
    steps = [json.loads((tmp_path / "sweep" / str(i) / "config.json").read_text())["training"]["steps"]
             for i in range(len(CFGS))]
    assert steps == [14, 12, 14, 14, 12, 12, 14]  # batchtopk, jumprelu and matryoshka hold out 2 calibration batches




@pytest.mark.unit
def test_a_sweep_produces_each_batch_once(tmp_path):
    """Every dictionary reads its held-out and first batches, the loop the rest: each batch is made once (making
    one may be a model's forward), as often as in the separate run that reads the most."""
    made = []

    def counted(start):
        for i, x in enumerate(DATA(start), start):
            made.append(i)
            yield x

    train(CFGS[1], counted, out=tmp_path / "alone")
    alone, made[:] = sorted(made), []
    train_sweep(CFGS, counted, outs=[tmp_path / "sweep" / str(i) for i in range(len(CFGS))])
    assert sorted(made) == alone == list(range(SPEC.n_batches))


@pytest.mark.equivalence
@pytest.mark.unit
def test_a_sweep_resumes_every_dictionary_exactly(tmp_path):
    outs = [tmp_path / "full" / str(i) for i in range(len(CFGS))]
    cut = [tmp_path / "cut" / str(i) for i in range(len(CFGS))]
    train_sweep(CFGS, DATA, outs=outs)
    with pytest.raises(Crash):
        train_sweep(CFGS, crashing(DATA, 11), outs=cut)
    positions = [torch.load(p / "checkpoint.pt", weights_only=True)["position"] for p in cut]
    assert positions == [11, 10, 11, 11, 10, 10, 11]  # the last checkpoint (every 3 steps) of each: steps 9 or 6
    train_sweep(CFGS, DATA, outs=cut, resume=True)
    for a, b in zip(outs, cut):
        same_run(a, b)


@pytest.mark.unit
def test_a_sweep_needs_data_it_can_reread():
    with pytest.raises(ValueError, match="needs data it can re-read"):
        train_sweep(CFGS[:2], iter(list(DATA(0))), outs=[None, None])
    with pytest.raises(ValueError, match="one output per config"):
        train_sweep(CFGS[:2], DATA, outs=[None])


# -- the command line ---------------------------------------------------------------------------------

FAST = ["--kernel-impl", "reference", "--batch-size", "256", "--eval-batches", "2", "--log-every", "5",
        "--latents", "32"]


@pytest.mark.integration
def test_cli_sweep_trains_every_combination_as_its_separate_run(tmp_path, planted_store, capsys):
    from conceptdict.cli.main import main

    # as docs/guide/train.md writes it: no --k (the sweep gives it) and no --tokens (each point takes its separate
    # run's default length; topk and batchtopk hold out different batches, so they train in two passes)
    assert main(["train", "--store", str(planted_store), "--out", str(tmp_path / "sweep"), *FAST,
                 "--sweep", "k=3,4", "--sweep", "kind=topk,batchtopk"]) == 0
    names = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert names == ["k-3_kind-batchtopk", "k-3_kind-topk", "k-4_kind-batchtopk", "k-4_kind-topk"]
    assert capsys.readouterr().out.count("\ndictionary: ") == 4
    alone = tmp_path / "alone"  # the thresholded kind, trained in the second pass
    assert main(["train", "--store", str(planted_store), "--out", str(alone), *FAST, "--k", "4",
                 "--kind", "batchtopk"]) == 0
    same_run(alone, tmp_path / "sweep" / "k-4_kind-batchtopk")
    assert main(["eval", str(tmp_path / "sweep" / "k-3_kind-topk")]) == 0  # held-out batches found


@pytest.mark.integration
def test_cli_sweep_over_the_batch_and_seed_trains_each_as_its_separate_run(tmp_path, planted_store, capsys):
    from conceptdict.cli.main import main

    fast = [a for a in FAST if a not in ("--batch-size", "256")]
    assert main(["train", "--store", str(planted_store), "--out", str(tmp_path / "sweep"), *fast, "--k", "3",
                 "--tokens", "5120", "--sweep", "batch_size=128,256", "--sweep", "seed=0,1"]) == 0
    capsys.readouterr()
    alone = tmp_path / "alone"
    assert main(["train", "--store", str(planted_store), "--out", str(alone), *fast, "--k", "3", "--tokens", "5120",
                 "--batch-size", "128", "--seed", "1"]) == 0
    same_run(alone, tmp_path / "sweep" / "batch_size-128_seed-1")


@pytest.mark.integration
def test_cli_sweep_of_kinds_holding_out_different_batches_takes_several_passes_with_tokens(tmp_path, planted_store,
                                                                                          capsys):
    """--tokens over three passes, topk beside the thresholded batchtopk (which also holds out calibration
    batches): each trains in its own pass and equals its separate run (this used to be refused)."""
    from conceptdict.cli.main import main

    assert main(["train", "--store", str(planted_store), "--out", str(tmp_path / "sweep"), *FAST, "--k", "3",
                 "--tokens", str(3 * 3072), "--sweep", "kind=topk,batchtopk"]) == 0
    capsys.readouterr()
    alone = tmp_path / "alone"
    assert main(["train", "--store", str(planted_store), "--out", str(alone), *FAST, "--k", "3", "--tokens",
                 str(3 * 3072), "--kind", "batchtopk"]) == 0
    same_run(alone, tmp_path / "sweep" / "kind-batchtopk")
    assert json.loads((alone / "config.json").read_text())["training"]["rows"] == 3 * 3072 // 256 * 256


@pytest.mark.unit
def test_cli_sweep_refusals(tmp_path, planted_store):
    from conceptdict.settings import ConfigError
    from conceptdict.cli.main import main

    base = ["train", "--store", str(planted_store), "--out", str(tmp_path / "s"), *FAST, "--k", "3", "--debug"]
    with pytest.raises(ValueError, match="--sweep device: one run trains on one device"):
        main([*base, "--sweep", "device=cpu,auto"])
    with pytest.raises(ConfigError, match="unknown key 'latent' in --sweep: did you mean 'latents'"):
        main([*base, "--sweep", "latent=16,32"])
    with pytest.raises(ConfigError, match=r"k is given twice, as k=3 \(--k\) and by the sweep k=3,4; give it once"):
        main([*base, "--sweep", "k=3,4"])
    no_k = [a for a in base if a not in ("--k", "3")]
    with pytest.raises(ConfigError, match=r"--sweep k='x': not a valid int"):
        main([*no_k, "--sweep", "k=3,x"])
    with pytest.raises(ValueError, match="sweep point k-40: k=40 must be at least 1 and below latents=32"):
        main([*no_k, "--sweep", "k=3,40"])
