"""bench/synth_sae_bench.py, the parts that run without sae-lens: every trainable single-source kind is benchmarked
(a kind added to the registry must be paired with a SAELens architecture or None), and the tables' ratios are taken
against SAELens' same architecture of the same scale and seed (of the same invocation where several are merged),
and an inner-weight sweep trains each matryoshka kind once per weight."""

import importlib.util
from pathlib import Path

import pytest
from conceptdict.saes.kinds import KINDS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("synth_sae_bench", ROOT / "bench" / "synth_sae_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_trainable_single_source_kind_is_benchmarked():
    bench = _bench()
    assert set(bench.PAIR) == {name for name, spec in KINDS.items() if spec.sources == "one" and spec.trainable}
    assert {arch for arch in bench.PAIR.values() if arch} <= set(bench.SAELENS)


def _row(lib, name, pair, seed, mcc, f1):
    return {"lib": lib, "name": name, "pair": pair, "scale": 16, "seed": seed, "mcc": mcc,
            "classification": {"f1_score": f1}, "explained_variance": 0.5, "sae_l0": 6.0, "dead_latents": 0,
            "samples": 1000, "seconds": 1.0}


def test_ratios_are_against_the_same_architecture_scale_and_seed():
    bench = _bench()
    rows = [_row("saelens", "topk", "topk", 0, 0.5, 0.4), _row("saelens", "topk", "topk", 1, 0.25, 0.8),
            _row("saelens", "matryoshka", "matryoshka", 0, 1.0, 1.0),
            _row("conceptdict", "topk", "topk", 0, 0.6, 0.2), _row("conceptdict", "topk", "topk", 1, 0.5, 0.8),
            _row("conceptdict", "spade", None, 0, 0.3, 0.3)]
    f1 = lambda r: r["classification"]["f1_score"]
    assert bench.ratio(rows[3], rows, lambda r: r["mcc"]) == "x1.20"
    assert bench.ratio(rows[4], rows, lambda r: r["mcc"]) == "x2.00"
    assert bench.ratio(rows[3], rows, f1) == "x0.50"
    assert bench.ratio(rows[5], rows, f1) == "-"  # no SAELens counterpart
    table = bench.tables(rows)
    assert "| 16 | conceptdict | topk | 0.550 | 0.500 | 0.500 | 6.0 | x1.60 (x1.20) | x0.75 (x0.50) |" in table
    assert "order by F1 | sa:matryoshka > sa:topk > co:topk > co:spade" in table


def test_inner_weight_sweep_runs_each_matryoshka_kind_once_per_weight():
    bench = _bench()
    assert bench.runs(["topk", "matryoshka"], None) == [("topk", "topk", {}), ("matryoshka", "matryoshka", {})]
    assert bench.runs(["topk", "matryoshka-absolute"], [0.03, 1.0]) == [
        ("topk", "topk", {}),
        ("matryoshka-absolute", "matryoshka-absolute@inner=0.03", {"matryoshka_inner_weight": 0.03}),
        ("matryoshka-absolute", "matryoshka-absolute@inner=1", {"matryoshka_inner_weight": 1.0})]


def test_merged_runs_compare_with_the_saelens_run_of_their_own_invocation():
    bench = _bench()
    # two invocations on the same world: SAELens topk trained for each one's sample count
    rows = [_row("saelens", "topk", "topk", 0, 0.5, 0.4) | {"tag": "cli"},
            _row("conceptdict", "topk", "topk", 0, 0.6, 0.2) | {"tag": "cli"},
            _row("saelens", "topk", "topk", 0, 0.25, 0.1) | {"tag": "more"},
            _row("conceptdict", "batchtopk", "topk", 0, 0.5, 0.3) | {"tag": "more"},
            _row("conceptdict", "topk@x", "topk", 0, 0.5, 0.8) | {"tag": "other"}]
    mcc = lambda r: r["mcc"]
    assert bench.ratio(rows[1], rows, mcc) == "x1.20"
    assert bench.ratio(rows[3], rows, mcc) == "x2.00"  # not against the "cli" run's 0.5
    assert bench.ratio(rows[4], rows, mcc) == "x1.00"  # no SAELens run of its own: the first one there is
    table = bench.tables(rows)
    assert "| 16 | saelens | topk [cli] | 0.500 |" in table and "| 16 | saelens | topk [more] | 0.250 |" in table


def test_results_files_name_their_tag_after_the_seeds():
    bench = _bench()
    assert bench.file_tag(Path("results-s16-seed0-more.json")) == "more"
    assert bench.file_tag(Path("results-s16-32-seed0-1-2.json")) == ""
    assert bench.file_tag(Path("results-s16-32-seed0-1-2-inner.json")) == "inner"
