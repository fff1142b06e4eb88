"""``export --format neuronpedia`` writes what Neuronpedia's importer reads.

The column table below is Neuronpedia's Prisma schema (hijohnnylin/neuronpedia,
apps/webapp/prisma/schema.prisma, models Neuron, Activation, Explanation, Source, SourceSet, Model,
SourceRelease) for the columns an export may carry; ``REQUIRED`` are the ones without a default. The importer
(apps/webapp/app/api/admin/import/route.ts) reads ``<modelId>/<sourceId>/{release,model,sourceset,source}.jsonl``
and ``{features,activations,explanations}/*.jsonl.gz``, and keeps only columns the table has, so an unknown key
would be dropped silently: the test refuses them.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from conceptdict.cli.main import main

pytestmark = pytest.mark.integration

S, F, I, B = "str", "float", "int", "bool"
COLUMNS = {
    "Neuron": {"modelId": S, "layer": S, "index": S, "sourceSetName": S, "creatorId": S, "createdAt": S,
               "maxActApprox": F, "hasVector": B, "vector": [F], "vectorLabel": S, "vectorDefaultSteerStrength": F,
               "hookName": S, "topkCosSimIndices": [I], "topkCosSimValues": [F], "neg_str": [S], "neg_values": [F],
               "pos_str": [S], "pos_values": [F], "frac_nonzero": F, "freq_hist_data_bar_heights": [F],
               "freq_hist_data_bar_values": [F], "logits_hist_data_bar_heights": [F],
               "logits_hist_data_bar_values": [F], "decoder_weights_dist": [F]},
    "Activation": {"id": S, "dataIndex": S, "index": S, "layer": S, "modelId": S, "dataSource": S, "maxValue": F,
                   "maxValueTokenIndex": I, "minValue": F, "tokens": [S], "values": [F], "creatorId": S,
                   "createdAt": S, "lossValues": [F], "binMin": F, "binMax": F, "binContains": F,
                   "qualifyingTokenIndex": I},
    "Explanation": {"id": S, "modelId": S, "layer": S, "index": S, "description": S, "authorId": S, "notes": S,
                    "scoreV1": F, "scoreV2": F, "typeName": S, "explanationModelName": S, "createdAt": S},
    "Source": {"id": S, "modelId": S, "hasDashboards": B, "inferenceEnabled": B, "hfRepoId": S, "hfFolderId": S,
               "visibility": S, "setName": S, "creatorId": S, "num_prompts": I, "num_tokens_in_prompt": I,
               "dataset": S, "notes": S, "createdAt": S},
    "SourceSet": {"modelId": S, "name": S, "hasDashboards": B, "visibility": S, "description": S, "type": S,
                  "creatorName": S, "creatorId": S, "releaseName": S, "urls": [S], "createdAt": S},
    "Model": {"id": S, "displayNameShort": S, "displayName": S, "creatorId": S, "visibility": S,
              "inferenceEnabled": B, "instruct": B, "layers": I, "neuronsPerLayer": I, "owner": S, "createdAt": S,
              "updatedAt": S},
    "SourceRelease": {"name": S, "visibility": S, "description": S, "descriptionShort": S, "urls": [S],
                      "creatorName": S, "creatorNameShort": S, "creatorId": S, "createdAt": S},
}
REQUIRED = {
    "Neuron": {"modelId", "layer", "index"},
    "Activation": {"id", "index", "layer", "modelId", "maxValue", "maxValueTokenIndex", "minValue", "tokens",
                   "values", "creatorId"},
    "Explanation": {"id", "modelId", "layer", "index", "description", "authorId"},
    "Source": {"id", "modelId", "setName", "creatorId"},
    "SourceSet": {"modelId", "name", "description", "creatorName", "creatorId"},
    "Model": {"id", "creatorId", "layers", "neuronsPerLayer", "owner"},
    "SourceRelease": {"name", "description", "creatorName", "creatorId"},
}
FILES = {"release.jsonl": "SourceRelease", "model.jsonl": "Model", "sourceset.jsonl": "SourceSet",
         "source.jsonl": "Source"}
PY = {S: str, F: (int, float), I: int, B: bool}


def _check(table: str, row: dict) -> None:
    missing = REQUIRED[table] - {k for k, v in row.items() if v is not None}
    assert not missing, f"{table} row lacks required {missing}"
    for key, value in row.items():
        assert key in COLUMNS[table], f"{table} has no column {key!r} (the importer would drop it)"
        want = COLUMNS[table][key]
        if value is None:
            assert key not in REQUIRED[table]
        elif isinstance(want, list):
            assert isinstance(value, list) and all(isinstance(v, PY[want[0]]) and not isinstance(v, bool)
                                                   or want[0] == B for v in value), (table, key)
        else:
            ok = isinstance(value, PY[want]) and (want == B or not isinstance(value, bool))
            assert ok, f"{table}.{key} = {value!r} is not {want}"


def read_export(where: Path) -> dict[str, list[dict]]:
    """Every record of a Neuronpedia export, checked against the schema, by table."""
    out: dict[str, list[dict]] = {}
    for name, table in FILES.items():
        out[table] = [json.loads(line) for line in (where / name).read_text().splitlines()]
    for sub, table in (("features", "Neuron"), ("activations", "Activation"), ("explanations", "Explanation")):
        files = sorted((where / sub).glob("*.jsonl.gz"))
        assert files, f"no {sub}/*.jsonl.gz"
        out[table] = [json.loads(line) for f in files for line in gzip.decompress(f.read_bytes()).splitlines()]
    for table, rows in out.items():
        for row in rows:
            _check(table, row)
    return out


def _sae(store_dir: Path, hookpoint: str, out: Path, latents: int = 16, k: int = 3) -> Path:
    from conceptdict.activations import ActivationStore
    from conceptdict.saes import SparseCoder, save_dictionary

    store = ActivationStore(store_dir)
    torch.manual_seed(0)
    model = SparseCoder(store.d_in(hookpoint), latents, k, kind="topk")
    return save_dictionary(model, out, extra={"stores": [str(store_dir)], "hookpoints": [hookpoint]})


def test_demo_like_dictionary(tiny_sentence_store, tmp_path, capsys):
    """As `make demo` names it: pooled sentence embeddings, vocabulary namer."""
    store_dir, model_dir = tiny_sentence_store
    sae = _sae(store_dir, "sentence.mean_normalized", tmp_path / "sae")
    (tmp_path / "words.txt").write_text("cat\ndog\nrain\nsnow\nbread\ncheese\nthe\nof\n")
    assert main(["name", str(sae), "--vocab", str(tmp_path / "words.txt"), "--model", str(model_dir),
                 "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "concepts")]) == 0
    rc = main(["export", str(tmp_path / "concepts"), "--format", "neuronpedia", "--neuronpedia-model",
               "tiny-bert", "--out", str(tmp_path / "np")])  # fmt: skip
    assert rc == 0, capsys.readouterr()
    where = tmp_path / "np" / "tiny-bert" / "0-conceptdict"
    got = read_export(where)
    concepts = json.loads((tmp_path / "concepts" / "concepts.json").read_text())["concepts"]
    assert [f["index"] for f in got["Neuron"]] == [str(c["id"]) for c in concepts]
    assert {f["layer"] for f in got["Neuron"] + got["Activation"] + got["Explanation"]} == {"0-conceptdict"}
    for f, c in zip(got["Neuron"], concepts):
        assert f["frac_nonzero"] == pytest.approx(c["frequency"]) and len(f["vector"]) == 32
        assert len(f["freq_hist_data_bar_heights"]) == len(f["freq_hist_data_bar_values"])
    named = {e["index"]: e for e in got["Explanation"]}
    for c in concepts:
        if c["name"]:
            assert named[str(c["id"])]["description"] == c["name"]
            assert named[str(c["id"])]["scoreV1"] == pytest.approx(c["score"])
    for a in got["Activation"]:
        assert len(a["tokens"]) == len(a["values"]) and a["maxValue"] == max(a["values"])
        assert a["values"][a["maxValueTokenIndex"]] == a["maxValue"]
    assert len({a["id"] for a in got["Activation"]}) == len(got["Activation"]) > 0
    assert got["Source"][0]["id"] == "0-conceptdict" and "sequence-level" in got["Source"][0]["notes"]


def test_token_level_dictionary_has_per_token_values_and_logits(tiny_lm_store, tmp_path, capsys):
    store_dir, model_dir = tiny_lm_store
    sae = _sae(store_dir, "blocks.1.hook_out", tmp_path / "sae")
    assert main(["name", str(sae), "--namer", "logit-lens", "--model", str(model_dir), "--top-k", "4",
                 "--out", str(tmp_path / "concepts")]) == 0  # fmt: skip
    rc = main(["export", str(tmp_path / "concepts"), "--format", "neuronpedia", "--out", str(tmp_path / "np")])
    assert rc == 0, capsys.readouterr()
    model_dirs = list((tmp_path / "np").iterdir())
    got = read_export(model_dirs[0] / "1-conceptdict")
    assert all(len(f["pos_str"]) == len(f["pos_values"]) == 10 for f in got["Neuron"])
    assert all(f["pos_values"][0] >= f["neg_values"][0] for f in got["Neuron"])
    assert {f["hookName"] for f in got["Neuron"]} == {"blocks.1.hook_resid_post"}
    from conceptdict.activations import ActivationStore
    from conceptdict.saes import load_dictionary

    store, model = ActivationStore(store_dir), load_dictionary(sae)
    a = got["Activation"][0]
    row = int(a["dataIndex"])
    with torch.no_grad():
        code = model.encode(store.rows("blocks.1.hook_out", row, row + 1).float())[0, int(a["index"])]
    assert float(code) in [pytest.approx(v, abs=1e-6) for v in a["values"]]  # the example's own token is there
    assert sum(v > 0 for v in a["values"]) >= 1


def test_a_crosscoder_over_two_hookpoints_is_named_and_exported_with_its_last_sources_logits(tiny_lm_store, tmp_path,
                                                                                              capsys):
    """A crosscoder over two hookpoints of one store: `name` encodes both, row-aligned (before: it fed one hookpoint's
    rows and stopped), and the Neuronpedia export keeps the concatenated decoder rows as each vector, the logit
    tables of the source the names read (the last) and each example's values from both hookpoints' rows."""
    from conceptdict.activations import ActivationStore, load_model
    from conceptdict.saes import SparseCoder, save_dictionary

    store_dir, model_dir = tiny_lm_store
    hps = ["blocks.0.hook_out", "blocks.1.hook_out"]
    torch.manual_seed(0)
    model = SparseCoder(32, 16, 3, kind="crosscoder", n_sources=2)
    sae = save_dictionary(model, tmp_path / "sae", extra={"stores": [str(store_dir)], "hookpoints": hps})
    assert main(["name", str(sae), "--namer", "logit-lens", "--model", str(model_dir), "--top-k", "4",
                 "--out", str(tmp_path / "concepts")]) == 0
    assert main(["export", str(tmp_path / "concepts"), "--format", "neuronpedia", "--out", str(tmp_path / "np")]) == 0
    capsys.readouterr()
    got = read_export(next(next((tmp_path / "np").iterdir()).iterdir()))
    lm = load_model(str(model_dir))
    directions = model.decoder_directions().detach().float()  # [L, 2, D]
    for f in got["Neuron"]:
        j = int(f["index"])
        assert f["vector"] == pytest.approx(directions[j].reshape(-1).tolist(), abs=1e-6)
        top = (directions[j, -1] @ lm.unembed().float()).topk(10)
        assert f["pos_str"] == lm.decode(top.indices.tolist())
    store = ActivationStore(store_dir)
    a = got["Activation"][0]
    row, j = int(a["dataIndex"]), int(a["index"])
    with torch.no_grad():
        code = model.encode(torch.stack([store.rows(h, row, row + 1).float() for h in hps], 1))[0, j]
    assert float(code) in [pytest.approx(v, abs=1e-6) for v in a["values"]]


def test_naming_a_crosscoder_over_two_stores_is_refused_with_what_reads_it(tiny_lm_store, tmp_path, capsys):
    """A crosscoder over two stores (as `conceptdict diff` trains it): `name` reads one store's rows, so it refuses
    before any work, saying where the latents' tags are and what measures it."""
    from conceptdict.saes import SparseCoder, save_dictionary

    store_dir, model_dir = tiny_lm_store
    model = SparseCoder(32, 16, 3, kind="crosscoder", n_sources=2)
    sae = save_dictionary(model, tmp_path / "sae", extra={"stores": [str(store_dir), str(store_dir)],
                                                           "hookpoints": ["blocks.1.hook_out"]})
    assert main(["name", str(sae), "--model", str(model_dir), "--out", str(tmp_path / "concepts")]) == 1
    err = capsys.readouterr().err
    assert "crosscoder over 2 stores" in err and "latents.csv" in err and "conceptdict eval" in err
    assert not (tmp_path / "concepts").exists()
