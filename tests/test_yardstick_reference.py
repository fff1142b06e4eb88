"""The yardsticks against the reference code: SAEBench 0.6.0 and sae-lens 6.54's synthetic evals ran on the checked-in
fixture (tests/fixtures/saebench/make_fixtures.py: a SAELens TopK SAE, 2048 labelled rows with their true features);
conceptdict reads the SAELens folder, imports the rows as a store and must give the same numbers.

Tolerances (absolute unless said):
- ground-truth: mcc, uniqueness, precision, recall, f1_score, accuracy, true_l0, sae_l0, dead_latents: 1e-6 (the same
  decoder, codes and counts); shrinkage, explained_variance: 1e-5 (float32 sums in the reference);
- core: explained_variance (SAEBench's formula), cossim, l2_ratio, relative_reconstruction_bias, l0, l1: 1e-5
  relative; frac_alive, freq_over_1/10_percent, normalized_freq_over_1/10_percent, average_max_encoder/decoder_
  cosine_sim and each latent's feature_density: 1e-6. Not compared: mse (SAEBench divides each row's squared error
  by the batch's token count; conceptdict reports per element) and explained_variance_legacy (not reported);
- sparse-probing: each class's test accuracy, every probe (raw / latents, k = 1, 2, 5, all): 0.02, the same draws on
  both sides and the same L2 logistic objective (sklearn's lbfgs there, float64 L-BFGS here; a point on the boundary
  may fall either way; one test point is 1/137 = 0.0073);
- tpp: every tpp_threshold_N_{total_metric, intended_diff_only, unintended_diff_only}, per class and averaged: 0.02
  (SAEBench's functions with sklearn probes there: the same draws; float32 there, float64 here);
- scr: every scr_dir1 / scr_dir2 / scr_metric_threshold_N of each run (a's classes 0/1 and 2/3 against b's 0/1 of
  scr.npz) and their means: 1e-6 (SAEBench's functions with sklearn probes there; its SCR draws nothing that changes
  a number: every task is all its inputs, so the only slack would be a test point on a probe's boundary: measured
  equal to the last digit).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import conceptdict as cd
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FIXTURES = Path(__file__).parent / "fixtures" / "saebench"
SIDE_PYTHON = Path(__file__).resolve().parents[1] / ".venv-saebench" / "bin" / "python"
REF = json.loads((FIXTURES / "reference.json").read_text()) if (FIXTURES / "reference.json").exists() else {}


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """conceptdict's eval --metrics core,sparse-probing,ground-truth of the fixture's SAE on its rows (all of them,
    in order), with --format saebench."""
    root = tmp_path_factory.mktemp("yardstick_ref")
    store = cd.import_array(FIXTURES / "data.npz", out=root / "store", key="acts",
                            true_features=FIXTURES / "true_features.npy", true_codes=FIXTURES / "true_codes.npy")
    got = cd.evaluate(FIXTURES / "sae", store=store.path, hookpoint="acts", rows_from="start", rows=2048,
                      contexts=0, metrics="core,sparse-probing,ground-truth,tpp", format="saebench",
                      out=root / "eval.json")
    return got, root


def test_ground_truth_equals_sae_lens_synthetic(ours):
    got = ours[0].yardsticks.results["ground-truth"]["summary"]
    ref = REF["synthetic"]
    for key in ("mcc", "uniqueness", "precision", "recall", "f1_score", "accuracy", "true_l0", "sae_l0",
                "dead_latents"):
        assert got[key] == pytest.approx(ref[key], abs=1e-6), key
    for key in ("shrinkage", "explained_variance"):
        assert got[key] == pytest.approx(ref[key], abs=1e-5), key


def test_core_equals_saebench_core(ours):
    summary, details = (ours[0].yardsticks.results["core"][k] for k in ("summary", "details"))
    ref = REF["core"]
    for key in ("explained_variance", "cossim", "l2_ratio", "relative_reconstruction_bias", "l0", "l1"):
        assert summary[key] == pytest.approx(ref[key], rel=1e-5), key
    for key in ("frac_alive", "freq_over_1_percent", "freq_over_10_percent", "normalized_freq_over_1_percent",
                "normalized_freq_over_10_percent", "average_max_encoder_cosine_sim", "average_max_decoder_cosine_sim"):
        assert summary[key] == pytest.approx(ref[key], abs=1e-6), key
    assert details["feature_density"] == pytest.approx(ref["feature_density"], abs=1e-6)


def test_sparse_probing_equals_saebench_probes(ours):
    per_class = ours[0].yardsticks.results["sparse-probing"]["details"]["per_class"]["label"]
    ref = REF["sparse_probing"]
    assert set(per_class) == set(ref)
    for name, classes in ref.items():
        assert per_class[name] == pytest.approx(classes, abs=0.02), name


def test_tpp_equals_saebench_tpp(ours):
    got = ours[0].yardsticks.results["tpp"]
    ref = REF["tpp"]
    assert set(got["summary"]) == set(ref["overall"])
    assert got["summary"] == pytest.approx(ref["overall"], abs=0.02)
    for c, metrics in ref["per_class"].items():
        assert got["details"]["per_class"]["label"][c] == pytest.approx(metrics, abs=0.02), c


@pytest.fixture(scope="module")
def scr_ours(tmp_path_factory):
    """conceptdict's eval --metrics scr of the fixture's SAE on scr.npz (two label columns a and b), --format
    saebench."""
    root = tmp_path_factory.mktemp("yardstick_scr")
    store = cd.import_array(FIXTURES / "scr.npz", out=root / "store", key="acts")
    return cd.evaluate(FIXTURES / "sae", store=store.path, hookpoint="acts", rows_from="start", rows=4096, contexts=0,
                       metrics="scr", format="saebench", out=root / "eval.json")


def test_scr_equals_saebench_scr(scr_ours):
    got = scr_ours.yardsticks.results["scr"]
    ref = REF["scr"]
    assert list(got["details"]["runs"]) == list(ref["runs"])
    for name, metrics in ref["runs"].items():
        assert got["details"]["runs"][name] == pytest.approx(metrics, abs=1e-6), name
    assert got["summary"] == pytest.approx(ref["overall"], abs=1e-6)


def test_saebench_reads_our_result_files(ours):
    """SAEBench's own graphing_utils.get_eval_results reads the --format saebench files (in the side environment;
    skipped without it). Its reader knows no 'synthetic' eval type, so the ground-truth file is not passed to it."""
    if not SIDE_PYTHON.exists():
        pytest.skip("no .venv-saebench (see tests/fixtures/saebench/make_fixtures.py for how to make it)")
    got, _ = ours
    files = [p for p in json.loads(got.path.read_text())["saebench"] if "/synthetic/" not in p and "/tpp/" not in p]
    proc = subprocess.run([str(SIDE_PYTHON), str(FIXTURES / "make_fixtures.py"), "--check-saebench", *files],
                          capture_output=True, text=True, timeout=600, env={"PATH": "/usr/bin:/bin"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = json.loads(proc.stdout.strip().splitlines()[-1])
    summary = {name: got.yardsticks.results[name]["summary"] for name in ("core", "sparse-probing")}
    for f in files:
        (entry,) = read[f].values()  # keyed by the file name: conceptdict_sae
        assert entry["sae_class"] == "topk" and entry["d_sae"] == "0k"  # its size label: thousands of latents
        if "/core/" in f:
            assert entry["l0"] == pytest.approx(summary["core"]["l0"]) and entry["l1"] == pytest.approx(
                summary["core"]["l1"])
        else:
            assert entry["sae_top_1_test_accuracy"] == pytest.approx(
                summary["sparse-probing"]["sae_top_1_test_accuracy"])


def read_with_saebench(files: list[str]) -> dict:
    """{file: what SAEBench's graphing_utils.get_eval_results reads from it}, run in the side environment."""
    proc = subprocess.run([str(SIDE_PYTHON), str(FIXTURES / "make_fixtures.py"), "--check-saebench", *files],
                          capture_output=True, text=True, timeout=600, env={"PATH": "/usr/bin:/bin"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_saebench_reads_our_scr_file(scr_ours):
    if not SIDE_PYTHON.exists():
        pytest.skip("no .venv-saebench (see tests/fixtures/saebench/make_fixtures.py for how to make it)")
    (f,) = json.loads(scr_ours.path.read_text())["saebench"]
    (entry,) = read_with_saebench([f])[f].values()
    summary = scr_ours.yardsticks.results["scr"]["summary"]
    assert entry["scr_metric_threshold_2"] == pytest.approx(summary["scr_metric_threshold_2"])
    assert entry["sae_class"] == "topk"
