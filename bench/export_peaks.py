"""Resident peak of ``conceptdict export --format json|html|neuronpedia`` of a 65,536-latent concept dictionary
(issue 55 item 3), each export in a fresh process, measured from its own start.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/export_peaks.py --work /tmp/export-peaks \\
        [--python OTHER_VENV/bin/python ...] [--lazy 0 1]

Built once in ``--work`` (as tests/lazy_capped.py builds its artifact): a store of 2,048 rows (D 512, imported from
an array: each row its own one-token context), a topk dictionary of 65,536 latents (D 512, k 32: 256 MiB of weights,
saved as 16 latent blocks of 16 MiB) and its concept dictionary, named by the vocabulary namer over 64 words (``--top-k 3 --n-bins 4``, the capped
test's settings: a ~112 MB concepts.json); a 256-latent one beside it for the warm-up. The concept dictionary's meta
records no model (its vocabulary's model id, ``planted``, is no model that Neuronpedia's logit tables could load).

Each measurement is one process (``--child``): it exports the small concept dictionary first (every import and code
path), reads VmRSS, resets VmHWM (``/proc/self/clear_refs``), exports the large one with the command line, and
prints VmHWM minus that VmRSS and the time. glibc returns freed blocks of 64 KiB or more
(``MALLOC_MMAP_THRESHOLD_``), as in tests/test_lazy_capped.py. ``--python`` adds interpreters to compare (another
checkout's venv: its own code); ``--lazy`` the values of CONCEPTDICT_LAZY that neuronpedia's export (which re-encodes
each top example with the dictionary) runs under: 0 loads the dictionary whole, 1 reads it a block at a time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharding import peak_mib, reset_peak, rss_mib  # noqa: E402  (the memory figures bench/sharding.py reads)

D, L, K, ROWS, WARM, PARTS = 512, 65536, 32, 2048, 256, 16
FORMATS = ("json", "html", "neuronpedia")


def save_parts(model, where: Path, parts: int, store: Path) -> Path:
    """``model`` saved as ``parts`` latent blocks (a block artifact, as a sharded run writes it): read a block at a
    time where the commands read it lazily."""
    from conceptdict.saes.artifact import finish_parts, save_dictionary_part
    from conceptdict.saes.model import SparseCoder

    whole, width = model.state_dict(), model.n_latents // parts
    for i in range(parts):
        a, b = i * width, (i + 1) * width
        part = SparseCoder(model.d_in, width, model.k, "topk")
        part.load_state_dict({k: v[:, a:b] if k == "W_enc" else v[a:b] if k in ("b_enc", "W_dec", "threshold") else v
                              for k, v in whole.items()})
        save_dictionary_part(part, where, i, parts)
    return finish_parts(part, where, parts, extra={"stores": [str(store)], "hookpoints": ["hp"]})


def build(work: Path) -> tuple[Path, Path]:
    """(the large concept dictionary, the small one) in ``work``, built unless there."""
    big, small = work / "concepts-big", work / "concepts-small"
    if (big / "concepts.json").exists() and (small / "concepts.json").exists():
        return big, small
    import torch
    from conceptdict.activations import import_array
    from conceptdict.activations.importer import ImportConfig
    from conceptdict.cli.main import main
    from conceptdict.naming import embed_vocabulary
    from conceptdict.naming.concepts_file import ConceptsFile
    from conceptdict.naming.written import ConceptsWriter
    from conceptdict.saes import SparseCoder
    from safetensors.torch import save_file

    work.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    save_file({"hp": torch.randn(ROWS, D, generator=g)}, str(work / "acts.safetensors"))
    store = import_array(ImportConfig(array=work / "acts.safetensors", out=work / "store", overwrite=True))
    words = [f"word{i}" for i in range(64)]
    (work / "words.txt").write_text("\n".join(words) + "\n")
    embed_vocabulary(words, "planted", "hp", lambda t: torch.randn(len(t), D, generator=g), work / "cache")
    for name, latents, parts in (("big", L, PARTS), ("small", WARM, 2)):
        torch.manual_seed(1)
        sae = save_parts(SparseCoder(D, latents, K, "topk"), work / f"sae-{name}", parts, store)
        named = work / f"named-{name}"
        assert main(["name", str(sae), "--vocab", str(work / "words.txt"), "--model", "planted", "--cache-dir",
                     str(work / "cache"), "--top-k", "3", "--n-bins", "4", "--chunk", "64", "--base-rows", "16",
                     "--logit-tokens", "0", "--out", str(named), "--overwrite"]) == 0  # fmt: skip
        file = ConceptsFile(named)  # the same records, the meta without the model
        with ConceptsWriter(work / f"concepts-{name}", file.n_concepts, file.directions_shape) as out:
            for concepts, directions in file.blocks(1024):
                out.add(concepts, directions)
            out.finish({k: v for k, v in file.meta.items() if k != "model"})
    return big, small


def child(fmt: str, big: Path, small: Path, out: Path) -> dict:
    """One export of ``big`` in this process, after a warm-up export of ``small``: its resident peak over its start."""
    from conceptdict.cli.main import main

    assert main(["export", str(small), "--format", fmt, "--out", str(out / "warm"), "--overwrite"]) == 0
    reset_peak()
    base, started = rss_mib(), time.perf_counter()
    code = main(["export", str(big), "--format", fmt, "--out", str(out / "big"), "--overwrite"])
    return {"format": fmt, "exit": code, "peak_mib": peak_mib() - base,
            "seconds": time.perf_counter() - started}


def measure(python: str, fmt: str, big: Path, small: Path, out: Path, lazy: str | None) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if lazy is not None:
        env["CONCEPTDICT_LAZY"] = lazy
    proc = subprocess.run([python, __file__, "--child", fmt, str(big), str(small), str(out)], capture_output=True,
                          text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{python} --child {fmt} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/export-peaks"))
    parser.add_argument("--python", nargs="*", default=[], help="other interpreters to measure (their own code)")
    parser.add_argument("--formats", nargs="*", default=list(FORMATS))
    parser.add_argument("--lazy", nargs="*", default=["0"], help="CONCEPTDICT_LAZY values for neuronpedia")
    parser.add_argument("--child", nargs=4, metavar=("FORMAT", "BIG", "SMALL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        fmt, big, small, out = args.child
        print(json.dumps(child(fmt, Path(big), Path(small), Path(out))))
        return
    big, small = build(args.work)
    size = (big / "concepts.json").stat().st_size
    print(f"concept dictionary: {L:,} latents, concepts.json {size / 1e6:.0f} MB; VmHWM over each export's start")
    print("| python | format | CONCEPTDICT_LAZY | resident peak | time |\n|---|---|---|---|---|")
    for python in [sys.executable, *args.python]:
        for fmt in args.formats:
            for lazy in args.lazy if fmt == "neuronpedia" else [None]:
                out = args.work / "out" / hashlib.sha1(python.encode()).hexdigest()[:8]  # one per interpreter
                got = measure(python, fmt, big, small, out, lazy)
                print(f"| {python} | {fmt} | {lazy or '-'} | +{got['peak_mib']:.1f} MiB | {got['seconds']:.0f} s |",
                      flush=True)


if __name__ == "__main__":
    main()
