"""A tiny 2-point sweep on the planted store as data (issue 51 item 5): the ``Sweep`` built from the runs (a mapping
name -> dictionary, with each run's final numbers read from its folder), and the ``Evaluation`` and ``Comparison``
of its dictionaries as rows."""

from __future__ import annotations

import json

import pytest

import conceptdict as cd
from conceptdict.saes.sweep_results import Sweep, loop_seconds

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sweep(planted_store, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "sae"
    trained = cd.train(store=planted_store, latents=32, sweep=["k=2,4"], batch_size=128, tokens=2048, out=out)
    assert isinstance(trained, Sweep)  # what cd.train returns for several dictionaries
    return trained, out


def test_a_sweep_is_its_dictionaries_by_name_with_their_final_numbers(sweep):
    s, out = sweep
    assert list(s) == ["k-2", "k-4"] and len(s) == 2 and s["k-4"].k == 4 and dict(s.items())["k-2"].k == 2
    with pytest.raises(KeyError, match=r"no dictionary 'k-8' in this sweep; it holds \['k-2', 'k-4'\]"):
        s["k-8"]
    assert s.swept == ["k"] and s.paths == {"k-2": out / "k-2", "k-4": out / "k-4"}
    df = s.to_pandas()
    assert list(df.columns) == ["name", "k", "fvu", "l0", "dead", "seconds", "steps", "rows", "measured_on", "path"]
    for i, name in enumerate(["k-2", "k-4"]):
        training = json.loads((out / name / "config.json").read_text())["training"]
        held = training["heldout_eval"]
        assert df["k"][i] == int(name[2:]) and df["measured_on"][i] == "held-out"
        assert (df["fvu"][i], df["l0"][i], df["dead"][i]) == (held["fvu"], held["l0"], held["dead_fraction"])
        assert (df["steps"][i], df["rows"][i]) == (training["steps"], training["rows"]) == (16, 2048)
        assert df["seconds"][i] == loop_seconds(out / name / "metrics.jsonl") > 0
    assert json.loads(json.dumps(s.to_dict(), allow_nan=False))["points"][1]["name"] == "k-4"
    lines = s.format().splitlines()
    assert lines[0].split() == ["name", "k", "FVU", "L0", "dead", "%", "steps", "seconds"] and len(lines) == 3
    assert lines[1].split()[:3] == ["k-2", "2", f"{df['fvu'][0]:.4f}"] and len({len(ln) for ln in lines}) == 1
    assert repr(s) == "Sweep(2 dictionaries over k: k-2, k-4)"


def test_seconds_sum_each_logged_lines_rows_over_its_rate(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"step": 1, "rows": 100, "tok_s": 50.0},
                                                       {"step": 3, "rows": 400, "tok_s": 100.0}]) + "\n")
    assert loop_seconds(path) == 100 / 50 + 300 / 100 and loop_seconds(tmp_path / "missing.jsonl") is None


def test_evaluation_and_comparison_as_rows(sweep, tmp_path):
    _, out = sweep
    ev = cd.evaluate(out / "k-2", contexts=0, out=tmp_path / "eval.json")
    row = ev.to_pandas()
    assert len(row) == 1 and row["fvu"][0] == ev.metrics.fvu and row["l0"][0] == ev.metrics.l0
    assert (row["kind"][0], row["hookpoint"][0], row["rows_from"][0]) == ("topk", "acts", ev.rows_from)
    d = json.loads(json.dumps(ev.to_dict(), allow_nan=False))
    assert d["metrics"]["fvu"] == ev.metrics.fvu and d["path"] == str(tmp_path / "eval.json")
    cmp = cd.compare([out / "k-2", out / "k-4"], out=tmp_path / "compare", rows=512)
    df = cmp.to_pandas()
    assert list(df.columns[:7]) == ["name", "kind", "n_latents", "k", "l0", "fvu", "on_frontier"]
    rows = {r["name"]: r for r in cmp.result["dictionaries"]}
    assert df["k"].tolist() == [2, 4] and df["fvu"].tolist() == [rows[n]["metrics"]["fvu"] for n in df["name"]]
    assert df["on_frontier"].tolist() == [n in cmp.result["frontier"] for n in df["name"]]
    assert df["decoder_max_cosine_mean"].tolist() == [rows[n]["weights"]["decoder_max_cosine_mean"] for n in df["name"]]
    other = [c for c in df.columns if c.startswith("matched.")]
    assert sorted(other) == sorted(f"matched.{n}" for n in df["name"])
    assert json.loads(json.dumps(cmp.to_dict(), allow_nan=False))["rows_from"] == cmp.rows_from
