"""`conceptdict name / show / cbm / export` end to end on a real (imported) store and a saved SparseCoder.

The vocabulary embeddings are planted in the on-disk cache, so no model is loaded: the store's rows are
noisy copies of 6 'word' embeddings, the dictionary's decoder rows are those embeddings, labels say which
word a row came from."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conceptdict.cli.main import main
from conceptdict.naming.vocab import embed_vocabulary

pytestmark = pytest.mark.integration

WORDS = ["river", "music", "stone", "green", "ocean", "paper", "apple", "quick"]
D = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from conceptdict.activations import import_array
    from conceptdict.activations.importer import ImportConfig
    from conceptdict.saes import SparseCoder, save_dictionary

    tmp = tmp_path_factory.mktemp("cli")
    gen = torch.Generator().manual_seed(0)
    E = torch.nn.functional.normalize(torch.randn(len(WORDS), D, generator=gen), dim=1)
    n = 600
    src = torch.randint(0, 6, (n,), generator=gen)
    x = E[src] * (1 + torch.rand(n, 1, generator=gen)) + 0.05 * torch.randn(n, D, generator=gen)
    save_file({"hp": x.contiguous(), "family": src}, str(tmp / "acts.safetensors"))
    store = import_array(ImportConfig(array=tmp / "acts.safetensors", out=tmp / "store", level="sequence"))
    model = SparseCoder(D, 6, 1, kind="topk")
    with torch.no_grad():
        model.W_dec.copy_(E[:6])
        model.W_enc.copy_(E[:6].T)
    sae = save_dictionary(model, tmp / "sae", extra={"stores": [str(store)], "hookpoints": ["hp"]})
    (tmp / "words.txt").write_text("\n".join(WORDS) + "\n")
    embed_vocabulary(WORDS, "planted", "hp", lambda t: E, tmp / "cache")
    return tmp, sae


def test_name_show_cbm_export(setup, capsys):
    tmp, sae = setup
    rc = main(["name", str(sae), "--vocab", str(tmp / "words.txt"), "--model", "planted",
               "--cache-dir", str(tmp / "cache"), "--out", str(tmp / "concepts"), "--top-k", "5"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads((tmp / "concepts" / "concepts.json").read_text())
    assert [c["name"] for c in doc["concepts"]] == WORDS[:6]
    assert all(abs(c["score"] - 1) < 1e-4 and c["frequency"] > 0.1 for c in doc["concepts"])
    assert (tmp / "concepts" / "concepts.safetensors").exists() and (tmp / "concepts" / "report" / "index.html").exists()
    assert "concepts.json" in out and "index.html" in out

    assert main(["show", str(tmp / "concepts"), "2"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("#2  stone") and "frequency:" in shown and "histogram:" in shown
    assert main(["show", str(tmp / "concepts"), "ocean"]) == 0 and "#4  ocean" in capsys.readouterr().out
    assert main(["show", str(tmp / "concepts"), "99"]) == 1 and "out of range" in capsys.readouterr().err

    rc = main(["cbm", str(tmp / "concepts"), "--label-column", "family", "--out", str(tmp / "cbm"),
               "--lam", "0.01", "--lam", "0.1"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    cbm = json.loads((tmp / "cbm" / "cbm.json").read_text())
    assert cbm["metrics"]["accuracy"] > 0.9 and cbm["metrics"]["probe_accuracy"] > 0.9
    assert cbm["classes"] == [str(i) for i in range(6)] and "linear probe" in out
    assert (tmp / "cbm" / "report" / "cbm-class-0.html").exists()
    curve = cbm["metrics"]["lambda_path"]
    assert [p["lambda"] for p in curve if p["l2"] is None][:2] == [0.01, 0.1] and "lambda trade-off" in out
    assert [p["l2"] for p in curve][:5] == [None, 1.0, 10.0, 100.0, 1000.0] and "refit L2 1000" in out
    assert "Sparsity trade-off" in (tmp / "cbm" / "report" / "cbm.html").read_text()
    fit = cbm["metrics"]["dictionary"]  # its decoder is the words the rows copy: it reconstructs them well
    assert fit["rows"] == 600 and fit["rows_from"] == "its training store's first rows" and fit["k"] == 1
    assert 0 < fit["fvu"] < 0.5 and fit["l0"] == pytest.approx(1.0) and fit["training_fvu"] is None

    assert main(["export", str(tmp / "concepts"), "--format", "json", "--out", str(tmp / "ej")]) == 0
    assert json.loads((tmp / "ej" / "concepts.json").read_text())["concepts"] == doc["concepts"]
    assert main(["export", str(tmp / "concepts"), "--format", "html", "--cbm", str(tmp / "cbm"),
                 "--out", str(tmp / "eh")]) == 0  # fmt: skip
    assert (tmp / "eh" / "index.html").exists() and (tmp / "eh" / "cbm.html").exists()
    assert main(["export", str(sae), "--format", "saelens", "--out", str(tmp / "es")]) == 0
    cfg = json.loads((tmp / "es" / "cfg.json").read_text())
    assert cfg["d_sae"] == 6 and cfg["metadata"]["hook_name"] == "hp"
    assert main(["export", str(sae), "--format", "json", "--out", str(tmp / "bad")]) == 1
    assert "conceptdict name" in capsys.readouterr().err


def test_llm_namer_without_a_server_is_one_line_naming_the_url_and_the_fix(setup, capsys):
    import socket

    tmp, sae = setup
    with socket.socket() as s:  # a port that was just free and that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    rc = main(["name", str(sae), "--namer", "llm", "--llm.url", url, "--llm.max-retries", "1", "--llm.backoff-s",
               "0.01", "--out", str(tmp / "llm-concepts")])  # fmt: skip
    err = capsys.readouterr().err  # the progress bars and log lines of the evidence pass come first
    assert rc == 1 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, err
    assert errors[0].startswith(f"conceptdict name: error: cannot reach the LLM server at {url}/chat/completions (")
    assert "after 2 attempts" in errors[0] and "--llm.url" in errors[0] and "--namer vocab" in errors[0]


def test_dictionary_fit_reads_training_heldout_rows_on_its_own_store_and_all_rows_elsewhere(tmp_path):
    import conceptdict as cd
    from safetensors.torch import save_file

    from conceptdict.activations import ActivationStore
    from conceptdict.concept_api import dictionary_fit
    from conceptdict.naming.sources import Run

    gen = torch.Generator().manual_seed(0)
    atoms = torch.randn(12, 8, generator=gen)
    for name, n in (("own", 2048), ("other", 300)):
        x = (torch.rand(n, 12, generator=gen) * (torch.rand(n, 12, generator=gen) < 0.2)) @ atoms
        save_file({"hp": x.contiguous()}, str(tmp_path / f"{name}.safetensors"))
        cd.import_array(array=tmp_path / f"{name}.safetensors", out=tmp_path / name, level="sequence")
    cd.train(store=[tmp_path / "own"], hookpoint=["hp"], out=tmp_path / "sae", latents=16, k=3, tokens=4096,
             batch_size=128, device="cpu")
    sae = cd.load(tmp_path / "sae")
    own = dictionary_fit(Run(sae, sae.config, ActivationStore(tmp_path / "own"), ["hp"], sae.path))
    assert own["rows_from"] == "training's held-out batches" and own["fvu"] == pytest.approx(own["training_fvu"])
    other = dictionary_fit(Run(sae, sae.config, ActivationStore(tmp_path / "other"), ["hp"], sae.path))
    assert other["rows_from"] == "not trained on" and other["rows"] == 300 and 0 < other["fvu"] < 1


def test_name_reads_a_dictionary_saved_in_latent_blocks_like_its_single_file(setup, capsys):
    """What a latent-sharded run above ``single_file_gib`` writes (one weights file per shard + weights.index.json)
    is named exactly as the same dictionary saved as one file."""
    from test_distributed_shards import blocks_of

    import conceptdict as cd
    from conceptdict.saes.artifact import finish_parts, save_dictionary_part

    tmp, sae = setup
    whole = cd.load(sae)
    blocks = blocks_of(whole, 2)
    for i, part in enumerate(blocks):
        save_dictionary_part(part, tmp / "sae-blocks", i, 2)
    finish_parts(blocks[0], tmp / "sae-blocks", 2, extra={k: whole.config[k] for k in ("stores", "hookpoints")})
    assert len(list((tmp / "sae-blocks").glob("weights-*-of-00002.safetensors"))) == 2
    common = ["--vocab", str(tmp / "words.txt"), "--model", "planted", "--cache-dir", str(tmp / "cache"),
              "--top-k", "5"]
    for src, out in [(sae, "named-one"), (tmp / "sae-blocks", "named-blocks")]:
        assert main(["name", str(src), *common, "--out", str(tmp / out)]) == 0, capsys.readouterr().out
    one, split = (json.loads((tmp / out / "concepts.json").read_text())["concepts"]
                  for out in ("named-one", "named-blocks"))
    assert [c["name"] for c in split] == WORDS[:6] and split == one
