"""`conceptdict erase` end to end: on a planted sequence store with a concept and a target column (every method,
every metric, the guarantees visible in the table), on a tiny causal LM's token store (the CE change of each map
spliced in), and the errors the issue lists."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conceptdict.cli.main import main

pytestmark = pytest.mark.integration

D = 16


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Rows = concept direction E[c] (3 classes) + target direction E[3] * y + noise; the dictionary's decoder
    rows are E, so the concept lives in latents 0..2."""
    from conceptdict.activations import import_array
    from conceptdict.activations.importer import ImportConfig
    from conceptdict.saes import SparseCoder, save_dictionary

    tmp = tmp_path_factory.mktemp("erase")
    gen = torch.Generator().manual_seed(0)
    E = torch.nn.functional.normalize(torch.randn(8, D, generator=gen), dim=1)
    n = 900
    c = torch.randint(0, 3, (n,), generator=gen)
    y = (torch.rand(n, generator=gen) < torch.tensor([0.25, 0.5, 0.75])[c]).long()
    x = 2 * E[c] + 1.5 * y[:, None] * E[3] + 0.3 * torch.randn(n, D, generator=gen)
    save_file({"hp": x.contiguous(), "concept": c, "target": y, "single": torch.zeros(n, dtype=torch.long)},
              str(tmp / "acts.safetensors"))
    store = import_array(ImportConfig(array=tmp / "acts.safetensors", out=tmp / "store", level="sequence"))
    model = SparseCoder(D, 8, 2, kind="topk")
    with torch.no_grad():
        model.W_dec.copy_(E)
        model.W_enc.copy_(E.T)
    sae = save_dictionary(model, tmp / "sae", extra={"stores": [str(store)], "hookpoints": ["hp"]})
    other = save_dictionary(model, tmp / "sae_other", extra={"stores": [str(store)], "hookpoints": ["elsewhere"]})
    return tmp, store, sae, other


def test_erase_table_on_planted_store(planted, capsys):
    tmp, store, sae, _ = planted
    out = tmp / "out"
    rc = main(["erase", "--store", str(store), "--concept-column", "concept", "--target-column", "target",
               "--dictionary", str(sae), "--ablate-latents", "3", "--mlp-epochs", "150", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    doc = json.loads((out / "erase.json").read_text())
    rec = {r["method"]: r for r in doc["records"]}
    assert list(rec) == ["none", "sae-ablation", "leace", "splince", "leace-switch", "midsteer"]
    for r in rec.values():
        for key in ("concept_linear_acc", "concept_mlp_acc", "concept_chance", "target_acc_before", "target_acc_after",
                    "target_cov_change", "displacement"):
            assert isinstance(r[key], float), (r["method"], key)
    chance = rec["none"]["concept_chance"]
    slack = 3 * (chance * (1 - chance) / doc["n_test"]) ** 0.5
    assert rec["none"]["concept_linear_acc"] > 0.9 and rec["none"]["displacement"] == 0
    assert rec["leace"]["concept_linear_acc"] < chance + slack
    assert rec["splince"]["concept_linear_acc"] < chance + slack
    assert rec["splince"]["target_cov_change_fit"] < 1e-5 < rec["leace"]["target_cov_change_fit"]
    assert rec["splince"]["target_acc_after"] >= rec["leace"]["target_acc_after"] - 0.02
    assert sorted(lat["id"] for lat in rec["sae-ablation"]["latents"]) == [0, 1, 2]
    assert rec["sae-ablation"]["concept_linear_acc"] < rec["none"]["concept_linear_acc"] - 0.3
    assert rec["midsteer"]["switch_rate"] > 0.8
    assert (out / "erase.html").read_text().count("<tr>") == 7
    for method in ("leace", "splince", "leace-switch", "midsteer"):
        assert (out / "erasers" / method / "eraser.safetensors").exists()
    assert "splince" in printed and "concept_linear_acc" in printed


def test_a_method_that_fails_to_fit_is_skipped_in_its_own_row(planted, capsys, monkeypatch):
    from conceptdict.naming.interventions import erase as erase_module

    def broken(*args, **kwargs):
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge\nsecond line")

    monkeypatch.setattr(erase_module, "fit_splince", broken)
    tmp, store, _, _ = planted
    out = tmp / "out_broken"
    rc = main(["erase", "--store", str(store), "--concept-column", "concept", "--target-column", "target",
               "--method", "leace", "--method", "splince", "--method", "midsteer", "--mlp-epochs", "20",
               "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rec = {r["method"]: r for r in json.loads((out / "erase.json").read_text())["records"]}
    assert list(rec) == ["leace", "splince", "midsteer"]
    assert rec["splince"]["skipped"] == "skipped: LinAlgError: linalg.eigh: The algorithm failed to converge"
    assert rec["splince"]["concept_linear_acc"] is None
    assert isinstance(rec["leace"]["concept_linear_acc"], float) and isinstance(rec["midsteer"]["switch_rate"], float)
    assert not (out / "erasers" / "splince").exists() and (out / "erasers" / "midsteer").exists()
    row = next(line for line in printed.splitlines() if line.startswith("splince"))
    assert "skipped: LinAlgError" in row
    assert "skipped: LinAlgError" in (out / "erase.html").read_text()


@pytest.mark.parametrize("args, message", [
    (["--concept-column", "single"], "at least two classes"),
    (["--concept-column", "concept", "--target-column", "missing"], "no target column 'missing'"),
    (["--concept-column", "nothere"], "no concept column 'nothere'"),
    (["--concept-column", "concept", "--dictionary", "OTHER"], "trained at hookpoint 'elsewhere'"),
    (["--concept-column", "concept", "--method", "leace", "--switch-to", "7"], "not a class of concept column"),
])
def test_erase_errors(planted, capsys, args, message):
    tmp, store, _, other = planted
    args = [str(other) if a == "OTHER" else a for a in args]
    rc = main(["erase", "--store", str(store), *args, "--out", str(tmp / "bad")])
    err = capsys.readouterr().err
    assert rc == 1 and message in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def lm_store(tmp_path_factory, tiny_lm_dir):
    """A token-level store of the tiny LM, one document per context, labelled by topic and by length."""
    from pathlib import Path

    from conceptdict.activations.cache import CacheConfig, cache_activations
    from fixtures_models import tiny_corpus

    docs = [{**d, "long": "yes" if len(d["text"].split()) > 18 else "no"} for d in tiny_corpus(90)]
    out = tmp_path_factory.mktemp("lm_erase") / "store"
    cfg = CacheConfig(model=str(tiny_lm_dir), hookpoints=["blocks.0.hook_out"], dataset="", out=Path(out),
                      context_length=32, batch_size=16, packing=False, progress=False)
    return cache_activations(cfg, records=docs)


def test_erase_on_a_causal_lm_reports_the_ce_change(lm_store, tmp_path, capsys):
    rc = main(["erase", "--store", str(lm_store), "--concept-column", "topic", "--target-column", "long",
               "--mlp-epochs", "50", "--contexts", "8", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rec = {r["method"]: r for r in json.loads((tmp_path / "out" / "erase.json").read_text())["records"]}
    assert rec["none"]["ce_change"] == pytest.approx(0, abs=1e-6)
    assert all(isinstance(r["ce_change"], float) for r in rec.values())
    assert rec["leace-switch"]["ce_change"] != 0 and "ce_change" in printed


def test_erase_on_the_default_sentence_encoder(tmp_path, capsys):
    """The default MiniLM over 300 standard-library docstrings: Y = module family, C = mentions "return"."""
    from conceptdict.activations import stdlib_docstrings

    docs = stdlib_docstrings()[::7][:300]
    with (tmp_path / "docs.jsonl").open("w") as f:
        for d in docs:
            f.write(json.dumps({"text": d["text"], "family": d["family"],
                                "mentions_return": "yes" if "return" in d["text"].lower() else "no"}) + "\n")
    assert main(["cache", "--model", "default", "--hookpoint", "sentence.mean_normalized", "--dataset",
                 str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "store")]) == 0
    rc = main(["erase", "--store", str(tmp_path / "store"), "--concept-column", "mentions_return", "--target-column",
               "family", "--mlp-epochs", "60", "--method", "none", "--method", "leace", "--method", "splince",
               "--method", "midsteer", "--out", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    rec = {r["method"]: r for r in json.loads((tmp_path / "out" / "erase.json").read_text())["records"]}
    chance = rec["none"]["concept_chance"]
    assert rec["none"]["concept_linear_acc"] > chance + 0.05
    assert rec["leace"]["concept_linear_acc"] < rec["none"]["concept_linear_acc"]
    assert rec["splince"]["target_cov_change_fit"] < 1e-4 < rec["leace"]["target_cov_change_fit"]
    assert rec["midsteer"]["switch_rate"] > 0.5


def test_a_saved_eraser_applies_to_a_store(planted, capsys):
    from conceptdict.activations import ActivationStore
    from conceptdict.naming.interventions.erasure import cross_covariance, load_eraser, one_hot

    tmp, store, _, _ = planted
    out = tmp / "fitted"
    assert main(["erase", "--store", str(store), "--concept-column", "concept", "--method", "leace",
                 "--mlp-epochs", "20", "--out", str(out)]) == 0
    assert main(["erase", "--store", str(store), "--apply", str(out / "erasers" / "leace"),
                 "--out", str(tmp / "erased_store")]) == 0, capsys.readouterr().err
    before, after = ActivationStore(store), ActivationStore(tmp / "erased_store")
    assert after.num_rows == before.num_rows and after.labels("concept") == before.labels("concept")
    assert after.manifest["derived_from"]["method"] == "leace"
    x, y = before.rows("hp", 0, before.num_rows).float(), after.rows("hp", 0, after.num_rows).float()
    assert torch.allclose(y, load_eraser(out / "erasers" / "leace")(x), atol=1e-5)
    c = torch.tensor([int(v) for v in before.labels("concept")])
    assert cross_covariance(x, one_hot(c)).abs().max() > 0.1
    assert cross_covariance(y, one_hot(c)).abs().max() < 0.02  # fitted on 70% of the rows
