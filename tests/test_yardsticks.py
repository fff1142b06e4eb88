"""`eval --metrics`: the field's yardsticks (naming/yardsticks) on a planted store that records its true features
and carries a label column, and on the planted store fixture that has neither."""

from __future__ import annotations

import json

import conceptdict as cd
import numpy as np
import pytest
import torch
from conceptdict.cli.main import main
from conceptdict.naming.yardsticks import parse_metrics
from conceptdict.naming.yardsticks.ground_truth import detection, mcc, uniqueness
from conceptdict.naming.yardsticks.sparse_probing import (
    logistic_probe,
    split,
    top_k_dims,
)
from conceptdict.naming.yardsticks.tpp import tpp_scores

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def truth_run(tmp_path_factory):
    """(store, trained SAE dir, atoms [24, 12], codes [N, 24]): planted rows with their true features and codes,
    and a label column (``has0``: whether atom 0 fired, as an integer)."""
    from generators.synthetic import (
        SyntheticSpec,
        planted_atoms,
        synthetic_batch_and_atoms,
    )

    root = tmp_path_factory.mktemp("truth")
    spec = SyntheticSpec(n_atoms=24, d=12, active=3, batch_size=256, n_batches=8, seed=3)
    atoms = planted_atoms(spec)
    xs, masks = zip(*(synthetic_batch_and_atoms(spec, i, atoms) for i in range(spec.n_batches)))
    x, mask = torch.cat(xs), torch.cat(masks)
    codes = mask.float()  # which atoms fired (the activation's size is not needed by any score)
    np.savez(root / "acts.npz", acts=x.numpy(), has0=mask[:, 0].numpy().astype(np.int64))
    np.save(root / "F.npy", atoms.numpy())
    np.save(root / "C.npy", codes.numpy())
    assert main(["store", "import", str(root / "acts.npz"), "--key", "acts", "--out", str(root / "store"),
                 "--true-features", str(root / "F.npy"), "--true-codes", str(root / "C.npy")]) == 0
    cd.train(store=root / "store", out=root / "sae", latents=32, k=3, batch_size=256, tokens=40000, eval_batches=1,
             seed=0)
    return root / "store", root / "sae", atoms, codes


def test_parse_metrics_names_the_known_ones():
    assert parse_metrics("core, sparse-probing") == ["core", "sparse-probing"]
    assert parse_metrics(["all"]) == ["core", "sparse-probing", "ground-truth", "autointerp", "tpp", "scr",
                                      "absorption"]
    with pytest.raises(ValueError, match="unknown metric .absorbtion.; known: core, sparse-probing, ground-truth, "
                                         "autointerp, tpp, scr, absorption or all"):
        parse_metrics("absorbtion")


def test_scores_on_hand_made_cases():
    true = torch.eye(3)
    assert mcc(torch.eye(3)[[2, 0, 1]] * 5, true) == pytest.approx(1.0)
    assert mcc(torch.tensor([[1.0, 1, 0], [0, 0, -1]]), true) == pytest.approx((2 ** -0.5 + 1) / 2)
    assert uniqueness(torch.tensor([[1.0, 0, 0], [2.0, 0.1, 0], [0, 0, 1]]), true) == pytest.approx(2 / 3)
    t = lambda *v: torch.tensor(v, dtype=torch.float64)
    got = detection(t(2, 0), t(2, 0), t(0, 0), t(0, 4))  # latent 0: P 0.5, R 1; latent 1 never fires: all 0
    assert got == pytest.approx({"precision": 0.25, "recall": 0.5, "f1_score": (2 / 3) / 2, "accuracy": 0.75})
    x = torch.tensor([[0.0, 3], [0, 2], [1, 0], [1, 0.1]])
    y = torch.tensor([1, 1, 0, 0])
    assert top_k_dims(x, y, 1).tolist() == [1]
    assert logistic_probe(x, y, x, y) == 1.0


def test_eval_metrics_all_on_a_store_with_truth_and_labels(truth_run, tmp_path, capsys):
    _, sae_dir, atoms, codes = truth_run
    out = tmp_path / "eval.json"
    assert main(["eval", str(sae_dir), "--metrics", "all", "--out", str(out), "--format", "saebench"]) == 0
    text = capsys.readouterr().out
    assert "[core]" in text and "[sparse-probing]" in text and "[ground-truth]" in text and "[tpp]" in text
    assert "skipped scr: scr: needs a store with two label columns" not in text  # one "scr:" (the refusal's own)
    assert "skipped scr: needs a store with two label columns" in text and "skipped absorption: needs a token" in text
    assert text.count("skipped") == 3 and "skipped autointerp: needs example texts" in text  # an imported store
    record = json.loads(out.read_text())
    r = record["yardsticks"]["results"]
    gt = r["ground-truth"]["summary"]
    # the same scores computed here from the decoder and the codes directly
    sae = cd.load(sae_dir)
    dec = sae.W_dec.detach()
    assert gt["mcc"] == pytest.approx(mcc(dec, atoms)) and 0.5 < gt["mcc"] <= 1
    assert gt["true_l0"] == pytest.approx(float((codes > 0).sum(1).double().mean()))
    assert 0 < gt["f1_score"] <= 1 and 0 < gt["uniqueness"] <= 1
    sp = r["sparse-probing"]["summary"]
    assert set(sp) == {"llm_test_accuracy", "sae_test_accuracy", *(f"{w}_top_{k}_test_accuracy" for w in ("llm", "sae")
                                                                  for k in (1, 2, 5))}
    assert sp["sae_top_5_test_accuracy"] > 0.6  # atom 0 fired or not: some latent should carry it
    core = r["core"]["summary"]
    assert core["l0"] == pytest.approx(record["metrics"]["l0"])
    assert core["explained_variance"] == pytest.approx(record["metrics"]["explained_variance_saebench"])
    assert core["l1"] > 0 and 0 <= core["frac_alive"] <= 1
    for eval_type in ("core", "sparse_probing", "synthetic"):
        path = out.parent / "saebench" / eval_type / "conceptdict_sae_eval_results.json"
        data = json.loads(path.read_text())
        assert data["sae_cfg_dict"]["d_sae"] == 32 and data["eval_result_metrics"]
    assert json.loads((out.parent / "saebench" / "sparse_probing" / "conceptdict_sae_eval_results.json")
                      .read_text())["eval_result_metrics"]["sae"]["sae_top_1_test_accuracy"] == sp[
        "sae_top_1_test_accuracy"]


def test_a_missing_input_is_refused_or_skipped(planted_store, tmp_path, capsys):
    sae = cd.train(store=planted_store, out=tmp_path / "sae", latents=32, k=3, batch_size=256, tokens=5000,
                   eval_batches=1)
    with pytest.raises(ValueError, match=r"ground-truth: needs a store that records its true features; .* "
                                         r"--true-features F.npy"):
        cd.evaluate(sae.path, metrics=["ground-truth"], out=tmp_path / "e.json")
    got = cd.evaluate(sae.path, metrics="all", out=tmp_path / "e.json")
    assert list(got.yardsticks.results) == ["core"]
    assert set(got.yardsticks.skipped) == {"sparse-probing", "ground-truth", "autointerp", "tpp", "scr", "absorption"}
    assert "needs a labelled store" in got.yardsticks.skipped["sparse-probing"]
    assert "skipped sparse-probing: needs a labelled store" in got.format()
    row = got.to_pandas()
    assert row["core.l0"].iloc[0] == pytest.approx(got.metrics.l0)
    assert set(got.yardsticks.to_pandas().columns) == {"metric", "name", "value"}


def test_no_metrics_keeps_eval_json_as_it_was(planted_store, tmp_path):
    sae = cd.train(store=planted_store, out=tmp_path / "sae", latents=32, k=3, batch_size=256, tokens=2560,
                   eval_batches=1)
    got = cd.evaluate(sae.path)
    assert got.yardsticks is None and "yardsticks" not in json.loads(got.path.read_text())
    with pytest.raises(ValueError, match="format='saebench' writes one file per metric"):
        cd.evaluate(sae.path, format="saebench")


def test_compare_puts_each_requested_metric_side_by_side(truth_run, tmp_path, capsys):
    store, sae_dir, _, _ = truth_run
    other = cd.train(store=store, out=tmp_path / "other", latents=16, k=2, batch_size=256, tokens=5000,
                     eval_batches=1)
    assert main(["compare", str(sae_dir), str(other.path), "--out", str(tmp_path / "cmp"), "--metrics",
                 "core,ground-truth"]) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("ground-truth.mcc "))
    assert len(line.split()) == 3  # the metric, then one number per dictionary
    got = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    by_name = {r["name"]: r["yardsticks"]["results"] for r in got["dictionaries"]}
    assert by_name["other"]["ground-truth"]["summary"]["mcc"] == pytest.approx(
        mcc(other.W_dec.detach(), torch.from_numpy(np.load(store.parent / "F.npy"))))
    assert by_name["other"]["core"]["summary"]["l0"] == pytest.approx(
        next(r for r in got["dictionaries"] if r["name"] == "other")["metrics"]["l0"])
    frame = cd.compare([sae_dir, other.path], out=tmp_path / "cmp2", metrics=["ground-truth"]).to_pandas()
    assert {"ground-truth.mcc", "ground-truth.f1_score"} <= set(frame.columns) and len(frame) == 2


def test_tpp_ablating_a_class_latents_hurts_its_probe_only():
    """Three classes, each carried by one raw dimension and one latent (decoder = identity): ablating the latents
    with the largest effect on class c's probe drops that probe to about chance and leaves the others."""
    g = torch.Generator().manual_seed(0)
    label = torch.arange(600) % 3
    raw = (0.3 * torch.randn(600, 6, generator=g) + 2.0 * torch.nn.functional.one_hot(label, 6)).double()
    codes = raw.clamp_min(0)
    train, test = split([0, 1, 2], label.tolist(), torch.Generator().manual_seed(0))
    got = tpp_scores(raw, codes, torch.eye(6, dtype=torch.float64), train, test, seed=0)
    assert set(got) == {"0", "1", "2"} and "tpp_threshold_500_total_metric" not in got["0"]  # only n <= L
    for c in got.values():
        assert c["tpp_threshold_2_intended_diff_only"] > 0.3
        assert abs(c["tpp_threshold_2_unintended_diff_only"]) < 0.1
        assert c["tpp_threshold_2_total_metric"] == pytest.approx(
            c["tpp_threshold_2_intended_diff_only"] - c["tpp_threshold_2_unintended_diff_only"])


def test_store_import_refuses_true_features_that_do_not_fit(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((10, 4), np.float32))
    np.save(tmp_path / "F.npy", np.zeros((3, 5), np.float32))
    np.save(tmp_path / "C.npy", np.zeros((9, 3), np.float32))
    with pytest.raises(ValueError, match=r"--true-features .* has shape \(3, 5\); it must be \[features, 4\]"):
        cd.import_array(tmp_path / "x.npy", out=tmp_path / "a", true_features=tmp_path / "F.npy")
    assert not (tmp_path / "a" / "manifest.json").exists()
    np.save(tmp_path / "F.npy", np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"--true-codes .* has shape \(9, 3\); it must be \[10, 3\]"):
        cd.import_array(tmp_path / "x.npy", out=tmp_path / "b", true_features=tmp_path / "F.npy",
                        true_codes=tmp_path / "C.npy")
    with pytest.raises(ValueError, match="needs true_features"):
        cd.import_array(tmp_path / "x.npy", out=tmp_path / "c", true_codes=tmp_path / "C.npy")


def test_core_names_the_spliced_scores_as_saebench_does(tiny_lm_store, tmp_path):
    """On a causal LM's token store, core carries eval's spliced CE/KL under SAEBench's names."""
    store, model_dir = tiny_lm_store
    sae = cd.train(store=store, hookpoint="blocks.0.hook_out", latents=64, k=4, batch_size=64, eval_batches=1,
                   out=tmp_path / "sae")
    got = cd.evaluate(sae.path, model=str(model_dir), contexts=4, metrics="all")
    core, m = got.yardsticks.results["core"]["summary"], got.metrics
    assert core["ce_loss_score"] == m.ce_loss_recovered and core["kl_div_score"] == m.kl_score
    assert core["ce_loss_without_sae"] == m.splice["ce_clean"] and core["kl_div_with_ablation"] == m.splice["kl_zero"]
    assert "needs a labelled store" in got.yardsticks.skipped["sparse-probing"]
