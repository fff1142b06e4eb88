"""The SAELens export loads in the real sae-lens and gives the same codes and reconstructions.

Runs in-process when ``sae_lens`` is importable, else through ``.venv-interop/bin/python`` (or
``.venv-saelens``) when that git-ignored side environment exists (tests/fixtures/foreign/make_fixtures.py says
how to make it); skipped otherwise. Also checks that sae-lens keeps our metadata (``hook_name``,
``model_name``, ``get_name()``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conceptdict.saes import SparseCoder
from conceptdict.saes.formats.export import export_dictionary

pytestmark = pytest.mark.slow  # importing sae-lens alone takes tens of seconds

ROOT = Path(__file__).resolve().parents[1]
SIDE_PYTHON = next((p for p in (ROOT / ".venv-interop" / "bin" / "python", ROOT / ".venv-saelens" / "bin" / "python")
                    if p.exists()), ROOT / ".venv-interop" / "bin" / "python")

CHECK = r"""
import json, sys, torch
from safetensors.torch import load_file
from sae_lens import SAE
out = {}
for d in sys.argv[2:]:
    t = load_file(d + "/probe.safetensors")
    sae = SAE.load_from_disk(d, device="cpu")
    with torch.no_grad():
        f = sae.encode(t["x"])
        x_hat = sae.decode(f)
    out[d] = {"arch": sae.cfg.architecture(), "codes": float((f - t["f"]).abs().max()),
              "recon": float((x_hat - t["x_hat"]).abs().max()), "hook_name": sae.cfg.metadata.hook_name,
              "model_name": sae.cfg.metadata.model_name, "name": sae.get_name()}
json.dump(out, open(sys.argv[1], "w"))
"""


def _model(kind):
    m = SparseCoder(12, 40, 5, kind)
    m.reset_parameters(torch.Generator().manual_seed(0))
    with torch.no_grad():
        m.b_enc.normal_(0.0, 0.1)
        m.b_dec.normal_(0.0, 0.2)
        m.threshold.fill_(0.15)
    return m


def test_export_loads_in_sae_lens(tmp_path):
    in_process = importlib.util.find_spec("sae_lens") is not None
    if not in_process and not SIDE_PYTHON.exists():
        pytest.skip("sae_lens is not installed (neither here nor in .venv-saelens)")
    dirs = []
    for kind in ("topk", "batchtopk-absolute", "relu"):
        m = _model(kind)
        d = tmp_path / kind
        export_dictionary(m, {"model": {"id": "tiny"}, "hookpoints": ["blocks.0.hook_out"]}, "saelens", d)
        x = torch.randn(64, 12, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            f = m.encode(x)
            save_file({"x": x, "f": f, "x_hat": m.decode(f)}, str(d / "probe.safetensors"))
        dirs.append(str(d))
    result = tmp_path / "result.json"
    python = sys.executable if in_process else str(SIDE_PYTHON)
    proc = subprocess.run([python, "-c", CHECK, str(result), *dirs], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(result.read_text())
    assert [got[d]["arch"] for d in dirs] == ["topk", "jumprelu", "standard"]
    for d in dirs:
        assert got[d]["codes"] < 1e-5 and got[d]["recon"] < 1e-5, (d, got[d])
        assert (got[d]["hook_name"], got[d]["model_name"]) == ("blocks.0.hook_resid_post", "tiny")
        assert got[d]["name"] == "sae_tiny_blocks.0.hook_resid_post_40"


def test_the_demos_dictionary_encodes_and_decodes_identically_in_sae_lens(tiny_sentence_store, tmp_path):
    """The dictionary `conceptdict demo` trains (its recipe, train's default kind) exported to SAELens: sae-lens'
    own encode and decode give our codes and reconstructions on the store's rows."""
    in_process = importlib.util.find_spec("sae_lens") is not None
    if not in_process and not SIDE_PYTHON.exists():
        pytest.skip("sae_lens is not installed (neither here nor in .venv-interop)")
    from conceptdict import demo_api as demo
    from conceptdict.activations import ActivationStore
    from conceptdict.saes import load_dictionary
    from conceptdict.saes.formats import load_dictionary_config

    store, _ = tiny_sentence_store
    ctx = demo.DemoContext(tmp_path / "demo", fast=True,
                           artifacts={"store": str(store), "hookpoint": "sentence.mean_normalized"})
    sae_dir = demo.train_step(ctx).artifacts["sae"]
    m = load_dictionary(sae_dir)
    d = tmp_path / "saelens"
    export_dictionary(m, load_dictionary_config(sae_dir), "saelens", d)
    x = ActivationStore(store).rows("sentence.mean_normalized", 0, 60).float()
    with torch.no_grad():
        f = m.encode(x)
        save_file({"x": x, "f": f, "x_hat": m.decode(f)}, str(d / "probe.safetensors"))
    result = tmp_path / "result.json"
    python = sys.executable if in_process else str(SIDE_PYTHON)
    proc = subprocess.run([python, "-c", CHECK, str(result), str(d)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(result.read_text())[str(d)]
    assert got["arch"] == "topk" and got["codes"] < 1e-5 and got["recon"] < 1e-5, got
