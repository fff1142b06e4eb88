"""`eval --metrics scr`: SAEBench's spurious correlation removal on a store with two label columns
(naming/yardsticks/scr.py): a hand-made case where the answer is known, the checked-in fixture's store through
`eval`, and the refusal of a store with one label column."""

from __future__ import annotations

import json
from pathlib import Path

import conceptdict as cd
import numpy as np
import pytest
import torch
from conceptdict.naming.yardsticks.scr import scr_scores, scr_tasks
from conceptdict.naming.yardsticks.sparse_probing import split

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "saebench"


def two_concepts(n: int = 1600, seed: int = 0) -> tuple[torch.Tensor, list]:
    """(raw [n, 2], quadrant (a, b) of each row): dimension 0 carries column A (+-1.0), dimension 1 column B
    (+-1.5, the stronger one: the biased probe leans on it), centred, the four quadrants equally often."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.arange(n) % 2, (torch.arange(n) // 2) % 2
    raw = 0.3 * torch.randn(n, 2, generator=g, dtype=torch.float64)
    raw[:, 0] += 1.0 * (2 * a - 1)
    raw[:, 1] += 1.5 * (2 * b - 1)
    return raw, list(zip(a.tolist(), b.tolist()))


def scores_of(decoder: torch.Tensor) -> dict[str, float]:
    """SCR of a dictionary whose latents are the positive parts of the raw rows along ``decoder``'s rows (which
    reconstruct them exactly: each direction and its negative)."""
    raw, quadrant = two_concepts()
    train, test = split([(1, 1), (0, 1), (1, 0), (0, 0)], quadrant, torch.Generator().manual_seed(0))
    tasks = scr_tasks(train, 1000), scr_tasks(test, 250)
    assert {k: len(v[1]) for k, v in tasks[1].items()} == {"A": 160, "B": 160, "biased": 160}  # m = 80 // 2
    codes = (raw @ decoder.T).clamp_min(0)
    assert torch.allclose(codes @ decoder, raw)
    return scr_scores(raw, codes, decoder, *tasks)


def test_latents_that_separate_the_concepts_remove_the_spurious_one():
    """One latent per sign of each concept: the two with the largest effect on B's probe are B's, ablating them
    leaves the biased probe reading A alone (SCR 1: it recovers A's own probe's accuracy); a dictionary whose
    latents each mix A and B cannot remove B without A (SCR about 0 or below)."""
    eye = torch.eye(2, dtype=torch.float64)
    good = scores_of(torch.cat([eye, -eye]))
    assert set(good) == {"scr_dir1_threshold_2", "scr_dir2_threshold_2", "scr_metric_threshold_2"}  # n <= 4 latents
    assert good["scr_dir1_threshold_2"] == pytest.approx(1.0, abs=0.05)
    assert good["scr_metric_threshold_2"] == good["scr_dir1_threshold_2"]  # the biased probe does worse on A: dir1
    s = 2 ** -0.5
    mixed = torch.tensor([[s, s], [s, -s]], dtype=torch.float64)
    bad = scores_of(torch.cat([mixed, -mixed]))
    assert bad["scr_metric_threshold_2"] < 0.2


def test_eval_scr_on_the_fixture_store_and_its_saebench_file(tmp_path):
    store = cd.import_array(FIXTURES / "scr.npz", out=tmp_path / "store", key="acts")
    assert store.manifest["label_keys"] == ["a", "b"]
    got = cd.evaluate(FIXTURES / "sae", store=store.path, hookpoint="acts", rows_from="start", rows=4096,
                      contexts=0, metrics="scr", format="saebench", out=tmp_path / "eval.json")
    r = got.yardsticks.results["scr"]
    assert list(r["details"]["runs"]) == ["a_0_1__b_0_1", "a_2_3__b_0_1"]  # a's classes in pairs against b's two
    assert set(r["summary"]) == {f"scr_{w}_threshold_{n}" for w in ("dir1", "dir2", "metric") for n in (2, 5, 10, 20)}
    assert "unreliable" in r["note"] and "unreliable" in got.format()
    path = tmp_path / "saebench" / "scr" / "conceptdict_sae_eval_results.json"
    data = json.loads(path.read_text())
    assert data["eval_type_id"] == "scr" and data["eval_result_metrics"]["scr_metrics"] == r["summary"]
    assert [d["dataset_name"] for d in data["eval_result_details"]] == ["a_0_1__b_0_1_results", "a_2_3__b_0_1_results"]


def test_a_store_with_one_label_column_is_refused(tmp_path):
    x = np.load(FIXTURES / "scr.npz")
    np.savez(tmp_path / "one.npz", acts=x["acts"], a=x["a"])
    store = cd.import_array(tmp_path / "one.npz", out=tmp_path / "store", key="acts")
    with pytest.raises(ValueError, match=r"scr: needs a store with two label columns .*; .* has one \(a\): cache it "
                                         r"with --label-column twice"):
        cd.evaluate(FIXTURES / "sae", store=store.path, hookpoint="acts", contexts=0, metrics="scr",
                    out=tmp_path / "e.json")
