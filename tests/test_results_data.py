"""Results as data (issue 51 item 5): every result's ``to_dict`` is plain JSON (strict: no NaN) and its ``to_pandas``
has the rows a notebook sorts or plots; pandas is optional and its absence is one line saying how to install it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from test_cbsae import scored  # noqa: F401 - the planted, scored concept dictionary fixture

from conceptdict.concept_api import CbSaeResult
from conceptdict.diff_api import DiffResult
from conceptdict.edit_api import EraseResult
from conceptdict.naming import CbmConfig, Concept, ConceptDictionary, train_cbm
from conceptdict.naming.bottleneck.cbm import load_cbm, save_cbm
from conceptdict.naming.bottleneck.cbsae import CbSaeConfig
from conceptdict.naming.bottleneck.cbsae_run import build_cbsae
from conceptdict.naming.interventions.erase import EraseConfig, Labelled, erase_table
from conceptdict.saes import SparseCoder, evaluate
from conceptdict.saes.diffing import decoder_table
from conceptdict.saes.tables import PANDAS_HINT, frame, plain, text_table

pytestmark = pytest.mark.unit


def strict_json(value):
    """``value`` through strict JSON (no NaN / inf, only plain types) and back."""
    return json.loads(json.dumps(value, allow_nan=False))


class Pair(NamedTuple):
    a: int
    b: Path


def test_plain_gives_json_types():
    value = {"t": torch.tensor([1.5, float("nan")]), "n": np.float32(2.5), "i": np.int64(3), "p": Path("runs/x"),
             "tuple": (1, Pair(2, Path("y"))), "inf": math.inf, "dtype": torch.float16, 4: np.array([[1, 2]])}
    assert strict_json(plain(value)) == {"t": [1.5, None], "n": 2.5, "i": 3, "p": "runs/x",
                                         "tuple": [1, {"a": 2, "b": "y"}], "inf": None, "dtype": "torch.float16",
                                         "4": [[1, 2]]}


def test_frame_flattens_nested_records_and_names_the_extra_without_pandas(monkeypatch):
    df = frame([{"name": "a", "m": {"x": 1, "y": {"z": 2}}, "l": [1, 2]}, {"name": "b", "extra": 3}], ["extra"])
    assert list(df.columns) == ["extra", "name", "m.x", "m.y.z", "l"]
    assert df["m.y.z"].tolist()[0] == 2 and df["l"][0] == [1, 2] and math.isnan(df["m.x"][1])
    monkeypatch.setitem(sys.modules, "pandas", None)  # pandas not installed
    with pytest.raises(ImportError, match=r'^to_pandas\(\) needs pandas, which is not installed: pip install '
                                          r'"conceptdict\[pandas\]"$'):
        frame([{"a": 1}])
    assert PANDAS_HINT == 'pip install "conceptdict[pandas]"'


def test_text_table_aligns_the_first_column_left_and_the_others_right():
    assert text_table(["name", "fvu"], [["k-2", "0.5"], ["k-16", "0.25"]]).splitlines() == [
        "name   fvu", "k-2    0.5", "k-16  0.25"]


def test_eval_result_is_one_row_of_its_metrics():
    model = SparseCoder(6, 12, 3)
    model.reset_parameters(torch.Generator().manual_seed(0))
    result = evaluate(model, [torch.randn(64, 6, generator=torch.Generator().manual_seed(1))])
    df = result.to_pandas()
    assert len(df) == 1 and df["fvu"][0] == result.fvu and df["l0"][0] == result.l0
    assert df["per_source_fvu"][0] == [result.fvu] and "density" not in df.columns


def _concepts() -> ConceptDictionary:
    concepts = tuple(Concept(j, f"c{j}", 0.5 + j / 10, namer="vocab", frequency=j / 100, stats={"max": float(j)},
                             scores={"embedding": {"auroc": 0.6 + j / 100, "score": float("nan")}},
                             names={"vocab": {"name": f"c{j}", "score": 0.1}}, confidence=None if j else 0.9)
                     for j in range(4))
    return ConceptDictionary(concepts, torch.randn(4, 6), {"sae_dir": Path("runs/sae"), "namer": "vocab"})


def test_concepts_are_one_row_per_latent():
    cd = _concepts()
    df = cd.to_pandas()
    assert len(df) == 4 and list(df.columns[:6]) == ["id", "name", "score", "frequency", "namer", "confidence"]
    assert df["id"].tolist() == [0, 1, 2, 3] and df.sort_values("score", ascending=False)["name"].iloc[0] == "c3"
    assert df["scores.embedding.auroc"].tolist() == pytest.approx([0.6, 0.61, 0.62, 0.63])
    assert df["stats.max"].tolist() == [0.0, 1.0, 2.0, 3.0] and df["names.vocab"][2] == "c2"
    d = strict_json(cd.to_dict())
    assert d["directions_shape"] == [4, 6] and d["meta"]["sae_dir"] == "runs/sae"
    assert d["concepts"][1]["scores"]["embedding"]["score"] is None and d["concepts"][0]["confidence"] == 0.9
    assert strict_json(cd.to_dict(directions=True))["directions"] == cd.directions.tolist()
    assert cd[1].to_dict()["name"] == "c1"


def test_cbm_curve_is_one_row_per_fit(tmp_path):
    gen = torch.Generator().manual_seed(0)
    labels = [i % 3 for i in range(120)]
    concepts = torch.rand(120, 5, generator=gen) + torch.nn.functional.one_hot(torch.tensor(labels), 5).float()
    cbm = train_cbm(concepts, labels, list("abcde"), CbmConfig(lambdas=[0.01, 0.1, 1.0], refit_l2=[0.01]))
    df = cbm.to_pandas()
    path = cbm.metrics["lambda_path"]
    assert len(df) == len(path) > 3 and list(df.columns[:7]) == ["lambda", "l2", "val_accuracy", "concepts_used",
                                                                "per_prediction", "zero_weights", "chosen"]
    assert df["chosen"].sum() == 1 and df[df["chosen"]]["lambda"].item() == cbm.lam
    d = strict_json(cbm.to_dict())
    assert d["lambda"] == cbm.lam and d["concepts"][0] == {"id": 0, "name": "a"} and "weight" not in d
    assert strict_json(cbm.to_dict(weights=True))["weight"] == cbm.weight.tolist()
    again = load_cbm(save_cbm(cbm, tmp_path / "cbm"))  # cbm.json is to_dict's content
    assert json.loads((tmp_path / "cbm" / "cbm.json").read_text()) == {"format_version": 1, **d}
    assert again.metrics == d["metrics"] and again.lam == cbm.lam


def test_diff_is_one_row_per_latent():
    model = SparseCoder(6, 10, 2, "crosscoder", n_sources=2)
    table = decoder_table(model)
    result = DiffResult(model, table, {"counts": table.counts(), "n_latents": 10}, {"json": Path("out/diff.json")})
    df = result.to_pandas()
    assert len(df) == 10 and list(df.columns[:6]) == ["latent", "tag", "norm_a", "norm_b", "delta", "cosine"]
    assert df["tag"].tolist() == table.tags
    assert strict_json(result.to_dict()) == {"counts": table.counts(), "n_latents": 10,
                                             "paths": {"json": "out/diff.json"}}


def test_erase_is_one_row_per_method():
    gen = torch.Generator().manual_seed(0)
    c = torch.randint(0, 2, (200,), generator=gen)
    x = torch.randn(200, 6, generator=gen) + 2 * torch.nn.functional.one_hot(c, 6).float()
    data = Labelled(x, c, ("no", "yes"), None, (), torch.arange(200))
    doc, _ = erase_table(data, EraseConfig(concept_column="c", methods=["none", "leace", "midsteer"],
                                           mlp_epochs=5))
    result = EraseResult(doc, {"table": Path("out/erase.json")})
    df = result.to_pandas()
    assert df["method"].tolist() == ["none", "leace", "midsteer"] and df.columns[1] == "concept_linear_acc"
    assert df["concept_linear_acc"][1] < df["concept_linear_acc"][0] and df["switch_rate"][2] > 0.5
    assert strict_json(result.to_dict())["paths"] == {"table": "out/erase.json"}


def test_cbsae_is_one_row_per_measure(scored):  # noqa: F811
    cd, src, embed = scored
    cfg = CbSaeConfig(min_interpretability=0.6, steps=50, lr=5e-3, batch_size=128)
    _, _, summary = build_cbsae(cd, src, ["w03", "w35"], cfg, embed=embed)
    result = CbSaeResult(Path("out/dictionary"), Path("out/concepts"), summary)
    df = result.to_pandas().set_index("measure")
    assert df.loc["fvu", ["before", "pruned", "after"]].tolist() == [summary["fvu"][k] for k in
                                                                      ("before", "pruned", "after")]
    assert df.loc["latents", "after"] == summary["n_kept"] + 1
    assert df.loc["interpretability (embedding) median", "after"] == summary["interpretability"]["after"]["median"]
    assert df.loc["w35 pearson", "after"] == summary["alignment_test"]["w35"]["pearson"]
    assert "steerability (steering) median" not in df.index  # not measured: the input has no steering scores
    d = strict_json(result.to_dict())
    assert d["dictionary"] == "out/dictionary" and d["added"] == ["w35"]
