"""One bottleneck over two dictionaries' concepts (``conceptdict cbm CONCEPTS --also OTHER``): a sentence-level
dictionary of the tiny BERT beside a token-level one of the same labelled texts (``naming.bottleneck.joined``).
Each part is scaled as it is alone, its inputs are matched by context index, and stores of other texts are refused
by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import conceptdict as cd
from conceptdict.cli.main import main
from conceptdict.naming.bottleneck.baseline import fitting_rows
from conceptdict.naming.bottleneck.cbm import encode_labels, explain_input
from conceptdict.naming.bottleneck.features import CbmFeatures
from conceptdict.naming.bottleneck.joined import align_inputs, check_same_texts, route_names

TOKEN_HOOKPOINT = "blocks.1.hook_out"
SETTINGS = {"label_column": "topic", "min_class_size": 3, "lam": [0.01, 0.1], "cv_folds": 0, "seed": 1}


def _named(tmp_path, name: str, store_dir, hookpoint: str, latents: int, seed: int):
    """A random dictionary on ``store_dir`` named by the context namer (no model needed): its concept folder."""
    from conceptdict.activations import ActivationStore
    from conceptdict.saes import SparseCoder, save_dictionary

    torch.manual_seed(seed)
    d = ActivationStore(store_dir).d_in(hookpoint)
    sae = save_dictionary(SparseCoder(d, latents, 4, kind="topk"), tmp_path / f"sae-{name}",
                          extra={"stores": [str(store_dir)], "hookpoints": [hookpoint]})  # fmt: skip
    assert main(["name", str(sae), "--namer", "context", "--out", str(tmp_path / name)]) == 0
    return tmp_path / name


@pytest.fixture(scope="module")
def two_routes(tiny_sentence_store, tmp_path_factory):
    """(sentence concepts, token concepts, a token store of other texts' concepts) of the tiny BERT."""
    from conceptdict.activations.cache import CacheConfig, cache_activations
    from fixtures_models import tiny_corpus

    store_dir, model_dir = tiny_sentence_store
    tmp = tmp_path_factory.mktemp("joined")
    stores = {}
    for name, seed in (("tokens", 0), ("other", 7)):
        cfg = CacheConfig(model=str(model_dir), hookpoints=[TOKEN_HOOKPOINT], dataset="", out=tmp / f"store-{name}",
                          context_length=48, batch_size=16, packing=False, progress=False)  # fmt: skip
        stores[name] = cache_activations(cfg, records=tiny_corpus(60, seed=seed))
    return (_named(tmp, "sentence", store_dir, "sentence.mean_normalized", 12, 0),
            _named(tmp, "tokens", stores["tokens"], TOKEN_HOOKPOINT, 10, 1),
            _named(tmp, "other", stores["other"], TOKEN_HOOKPOINT, 10, 2))


@pytest.mark.integration
def test_each_part_is_scaled_as_alone_and_named_by_its_route(two_routes, tmp_path):
    sentence, tokens, _ = two_routes
    joined = cd.cbm(sentence, also=tokens, out=tmp_path / "cbm", **SETTINGS)
    alone = [cd.cbm(c, **SETTINGS) for c in (sentence, tokens)]
    assert torch.equal(joined.scale, torch.cat([a.scale for a in alone]))  # same split, same probes, same rule
    assert joined.weight.shape[1] == 22 and joined.concept_ids == tuple(range(22))
    s_names, t_names = cd.load_concepts(sentence).names, cd.load_concepts(tokens).names
    assert list(joined.concept_names) == ([f"sentence.mean_normalized: {n}" for n in s_names]
                                          + [f"{TOKEN_HOOKPOINT}: {n}" for n in t_names])  # fmt: skip
    parts = joined.metrics["parts"]
    assert [(p["route"], p["width"]) for p in parts] == [("sentence.mean_normalized", 12), (TOKEN_HOOKPOINT, 10)]
    assert sum(p["used"] for p in parts) == joined.metrics["concepts_used"]
    assert sum(p["contribution_share"] for p in parts) == pytest.approx(1.0)
    assert parts[0]["own_probe_accuracy"] is None  # the CBM's probe
    assert 0 <= joined.metrics["probe_all_parts_accuracy"] <= 1 and alone[0].metrics.get("probe_all_parts_accuracy") \
        is None  # a probe on both stores' raw inputs beside the first's; none for one dictionary
    assert parts[1]["own_probe_accuracy"] == pytest.approx(alone[1].metrics["probe_accuracy"])
    doc = json.loads((tmp_path / "cbm" / "cbm.json").read_text())
    assert doc["meta"]["also"] == [str(tokens)]
    with pytest.raises(ValueError, match=rf"reads 22 \(12 of sentence.mean_normalized \+ 10 of {TOKEN_HOOKPOINT}"):
        joined.logits(torch.zeros(3, 12))  # one dictionary's concepts (e.g. steer --cbm's) are refused by name
    feats = cd.cbm_features(tmp_path / "cbm")  # what it reads, read back from what it records
    assert torch.equal(feats.concepts, torch.cat([cd.cbm_features(a).concepts for a in alone], 1))
    y, _, keep = encode_labels(feats.labels, SETTINGS["min_class_size"])
    test = fitting_rows(y, 0.15, 0.2, SETTINGS["seed"], 0, 4000)[0].test
    predicted = joined.logits(feats.concepts[keep][test]).argmax(1)
    assert float((predicted == y[test]).float().mean()) == pytest.approx(joined.metrics["accuracy"])
    assert all(c.name.split(": ")[0] in ("sentence.mean_normalized", TOKEN_HOOKPOINT)
               for c in explain_input(joined, feats.concepts[0]))  # fmt: skip
    html = (tmp_path / "cbm" / "report" / "cbm.html").read_text()
    assert f"concepts of {TOKEN_HOOKPOINT}" in html and "concepts per prediction (median)" in html


@pytest.mark.integration
def test_the_command_line_takes_also_and_prints_each_part(two_routes, tmp_path, capsys):
    sentence, tokens, _ = two_routes
    assert main(["cbm", str(sentence), "--also", str(tokens), "--label-column", "topic", "--lam", "0.01",
                 "--cv-folds", "0", "--min-class-size", "3", "--out", str(tmp_path / "cbm")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    parts = [line for line in out.splitlines() if line.startswith("concepts of ")]
    routes = [p.split(":")[0].removeprefix("concepts of ") for p in parts]
    assert routes == ["sentence.mean_normalized", TOKEN_HOOKPOINT]
    starts = {len(p) - len(p.split(":", 1)[1].lstrip()) for p in parts}
    assert len(starts) == 1  # the counts line up, whatever the hookpoints' lengths
    assert "probe (every part)" in out
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from cbm_explain import main as explain  # docs/results/cbm.md's example explanations, from the folder alone

    assert explain([str(tmp_path / "cbm"), "--inputs", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len([x for x in lines if x.startswith("- ")]) == 3 and lines[1].lstrip().startswith("sentence.mean_")


@pytest.mark.integration
def test_a_store_of_other_texts_is_refused_by_name(two_routes):
    sentence, _, other = two_routes
    with pytest.raises(ValueError, match=r"were cached from other texts \(dataset '[0-9a-f]+' against") as err:
        cd.cbm(sentence, also=other, **SETTINGS)  # the same labels in the same order: only the texts differ
    assert "--packing false" in str(err.value)


@pytest.mark.integration
def test_added_concepts_are_refused_with_also(two_routes):
    sentence, tokens, _ = two_routes
    with pytest.raises(ValueError, match="add_pairs=2"):
        cd.cbm(sentence, also=tokens, add_pairs=2, **SETTINGS)


def _feats(inputs, labels, width=2, offset=0.0):
    n = len(inputs)
    x = torch.arange(n * width, dtype=torch.float32).reshape(n, width) + offset
    return CbmFeatures(x, x[:, :1].clone(), list(labels), torch.tensor(inputs))


@pytest.mark.unit
def test_align_inputs_reorders_by_context_index():
    first = _feats([0, 1, 2, 3], "abab")
    other = _feats([3, 1, 0, 2, 9], ["b", "b", "a", "a", "z"], offset=100.0)
    got = align_inputs(first, other, "S", "T")
    assert torch.equal(got.concepts, other.concepts[[2, 1, 3, 0]]) and got.labels == list("abab")
    assert torch.equal(got.inputs, first.inputs)


@pytest.mark.unit
def test_align_inputs_names_what_is_missing_or_relabelled():
    first = _feats([0, 1, 2], "aba")
    with pytest.raises(ValueError, match=r"1 of 3 inputs of S \(e.g. context 2\) are not in T"):
        align_inputs(first, _feats([0, 1], "ab"), "S", "T")
    with pytest.raises(ValueError, match=r"1 of 3 inputs have another label in T than in S \(context 1: 'a'"):
        align_inputs(first, _feats([0, 1, 2], "aaa"), "S", "T")
    with pytest.raises(ValueError, match="records no context index"):
        align_inputs(first, first._replace(inputs=None), "S", "T")


@pytest.mark.unit
def test_check_same_texts_reads_the_manifests_fingerprints():
    from types import SimpleNamespace

    def store(path, sha=None, records=None, split="train"):
        return SimpleNamespace(path=path, manifest={"dataset": {"sha256": sha, "records_sha256": records},
                                                    "config": {"text_column": "text", "split": split}})

    check_same_texts(store("a", sha="1"), store("b", sha="1"))
    check_same_texts(store("a"), store("b", records="2"))  # one records none: context index and labels decide
    with pytest.raises(ValueError, match=r"stores a and b were cached from other texts \(split 'train' against 'test'"):
        check_same_texts(store("a", sha="1"), store("b", sha="1", split="test"))
    with pytest.raises(ValueError, match="dataset '1' against '2'"):
        check_same_texts(store("a", sha="1"), store("b", records="2"))


@pytest.mark.unit
def test_route_names_number_a_shared_hookpoint():
    assert route_names(["a", "b"]) == ["a", "b"]
    assert route_names(["a", "a", "b"]) == ["a#0", "a#1", "b"]


@pytest.mark.unit
def test_a_gap_note_points_one_dictionary_to_also():
    from conceptdict.naming.bottleneck.notes import gap_notes

    alone = {"probe_gap": 0.05, "probe_accuracy": 0.9, "accuracy": 0.85}
    assert any("--also" in n for n in gap_notes(alone))
    assert not any("--also" in n for n in gap_notes({**alone, "parts": [{"route": "a"}, {"route": "b"}]}))
    assert gap_notes({**alone, "probe_gap": 0.01}) == []  # within the 2 points: no notes at all
