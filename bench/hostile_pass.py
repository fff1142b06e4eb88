"""A hostile pass over every command: bad inputs, each run as a user would, with its outcome.

    python bench/hostile_pass.py [--work DIR] [--only SUBSTRING]

Builds a small store, two dictionaries, their concept dictionaries and a CBM with the bundled default model
(about two minutes, reused from --work when present), then runs each case below as its own ``conceptdict``
process and prints one row per case: the exit code, whether a traceback was printed, and the error's first
line. ``expect`` says what a right outcome is: ``error`` (a non-zero exit with one line and no traceback) or
``ok`` (exit 0: the input is valid and the result right). A case whose outcome differs is marked ``!!``; the
script exits 1 when any is. The issue-39 cases that must stay fixed are tests (tests/test_hardening2.py,
tests/test_outdirs.py, tests/test_hardening.py); this pass is the wider net around them.
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
CD = [sys.executable, "-c", "import sys; from conceptdict.cli.main import main; sys.exit(main())"]


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CD, *argv], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)


def build(work: Path) -> None:
    """The fixtures: q/store, q/sae, q/sae2 (another seed), q/concepts, q/concepts2, q/cbm, and bad array files."""
    steps = [
        ["cache", "--model", "default", "--hookpoint", "sentence.mean_normalized", "--dataset", "stdlib-docstrings",
         "--tokens", "600", "--out", "q/store"],
        ["train", "--store", "q/store", "--latents", "128", "--k", "8", "--batch-size", "64", "--tokens", "20000",
         "--out", "q/sae"],
        ["train", "--store", "q/store", "--latents", "128", "--k", "8", "--batch-size", "64", "--tokens", "20000",
         "--seed", "5", "--out", "q/sae2"],
        ["name", "q/sae", "--vocab", "wordfreq:en:3000", "--out", "q/concepts"],
        ["name", "q/sae2", "--vocab", "wordfreq:en:3000", "--out", "q/concepts2"],
        ["cbm", "q/concepts", "--label-column", "family", "--out", "q/cbm"],
    ]
    for argv in steps:
        if not (work / argv[argv.index("--out") + 1]).exists():
            done = run(argv, work)
            if done.returncode:
                raise SystemExit(f"building {argv}: {done.stderr[-2000:]}")
    a = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    np.save(work / "big_endian.npy", a.astype(">f4"))
    np.save(work / "objects.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    np.save(work / "one_d.npy", a[:, 0])
    np.save(work / "three_d.npy", a.reshape(8, 8, 8))
    np.save(work / "ints.npy", (a * 10).astype(np.int64))
    full = (work / "big_endian.npy").read_bytes()
    (work / "truncated.npy").write_bytes(np.lib.format.magic(1, 0) + full[6:len(full) // 2])
    (work / "notes.txt").write_text("not an array\n")
    (work / "list.json").write_text("[1, 2]\n")
    (work / "strings.json").write_text('{"latents": "many", "k": 8}\n')
    (work / "blank.txt").write_text("\n \n\n")
    (work / "bad.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")


# (name, argv, expect); paths are relative to the work directory
CASES: list[tuple[str, list[str], str]] = [
    ("train latents 0", ["train", "--store", "q/store", "--latents", "0", "--k", "1", "--out", "o/t1"], "error"),
    ("train k 0", ["train", "--store", "q/store", "--latents", "16", "--k", "0", "--out", "o/t2"], "error"),
    ("train k >= latents", ["train", "--store", "q/store", "--latents", "16", "--k", "16", "--out", "o/t3"], "error"),
    ("train batch-size 0", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--batch-size", "0",
                            "--out", "o/t4"], "error"),
    ("train batch-size -5", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--batch-size", "-5",
                             "--out", "o/t5"], "error"),
    ("train lr -1", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--lr", "-1", "--out", "o/t6"],
     "error"),
    ("train lr 0", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--lr", "0", "--out", "o/t7"],
     "error"),
    ("train tokens 0", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--tokens", "0",
                        "--out", "o/t8"], "error"),
    ("train tokens -100", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--tokens", "-100",
                           "--out", "o/t9"], "error"),
    ("train unknown kind", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--kind", "nosuch",
                            "--out", "o/t10"], "error"),
    ("train unknown hookpoint", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--hookpoint",
                                 "nosuch", "--out", "o/t11"], "error"),
    ("train missing store", ["train", "--store", "nowhere", "--latents", "16", "--k", "2", "--out", "o/t12"],
     "error"),
    ("train a dictionary as the store", ["train", "--store", "q/sae", "--latents", "16", "--k", "2",
                                         "--out", "o/t13"], "error"),
    ("train on cuda without one", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--device", "cuda",
                                   "--out", "o/t14"], "error"),
    ("train --resume with nothing to resume", ["train", "--store", "q/store", "--latents", "16", "--k", "2",
                                               "--resume", "--out", "o/t15"], "error"),
    ("train sweep field also a flag", ["train", "--store", "q/store", "--latents", "16", "--k", "4", "--sweep",
                                       "k=2,4", "--tokens", "2000", "--out", "o/t16"], "error"),
    ("train sweep unknown field", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--sweep",
                                   "nosuch=1,2", "--out", "o/t17"], "error"),
    ("train sweep without values", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--sweep", "k=",
                                    "--out", "o/t18"], "error"),
    ("train missing config file", ["train", "--store", "q/store", "--config", "nowhere.json", "--out", "o/t19"],
     "error"),
    ("train config file holding a list", ["train", "--store", "q/store", "--config", "list.json", "--out", "o/t20"],
     "error"),
    ("train config file with text for a number", ["train", "--store", "q/store", "--config", "strings.json",
                                                  "--out", "o/t21"], "error"),
    ("train aux-alpha -1", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--aux-alpha", "-1",
                            "--out", "o/t22"], "error"),
    ("train seed -1", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--seed", "-1",
                       "--out", "o/t23"], "error"),
    ("train out is a file", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--out", "notes.txt"],
     "error"),
    ("eval rows 0", ["eval", "q/sae", "--rows", "0"], "error"),
    ("eval rows -1", ["eval", "q/sae", "--rows", "-1"], "error"),
    ("eval batch-size 0", ["eval", "q/sae", "--batch-size", "0"], "error"),
    ("eval missing dictionary", ["eval", "nowhere"], "error"),
    ("eval a store as the dictionary", ["eval", "q/store"], "error"),
    ("eval missing --store", ["eval", "q/sae", "--store", "nowhere"], "error"),
    ("eval unknown hookpoint", ["eval", "q/sae", "--hookpoint", "nosuch"], "error"),
    ("compare one dictionary", ["compare", "q/sae", "--store", "q/store", "--out", "o/c1"], "error"),
    ("compare a store", ["compare", "q/sae", "q/store", "--store", "q/store", "--out", "o/c2"], "error"),
    ("name unknown wordfreq language", ["name", "q/sae", "--vocab", "wordfreq:xx:100", "--out", "o/n1"], "error"),
    ("name missing vocabulary file", ["name", "q/sae", "--vocab", "nowhere.txt", "--out", "o/n2"], "error"),
    ("name a store", ["name", "q/store", "--vocab", "wordfreq:en:100", "--out", "o/n3"], "error"),
    ("name wordfreq size 0", ["name", "q/sae", "--vocab", "wordfreq:en:0", "--out", "o/n4"], "error"),
    ("name quantile 1.5", ["name", "q/sae", "--vocab", "wordfreq:en:100", "--quantile", "1.5", "--out", "o/n5"],
     "error"),
    ("name into its own dictionary", ["name", "q/sae", "--vocab", "wordfreq:en:100", "--out", "q/sae"], "error"),
    ("cbm unknown label column", ["cbm", "q/concepts", "--label-column", "nosuch", "--out", "o/b1"], "error"),
    ("cbm negative lambda", ["cbm", "q/concepts", "--label-column", "family", "--lam", "-1", "--out", "o/b2"],
     "error"),
    ("cbm val-fraction 1.5", ["cbm", "q/concepts", "--label-column", "family", "--val-fraction", "1.5",
                              "--out", "o/b3"], "error"),
    ("cbm test-fraction 0", ["cbm", "q/concepts", "--label-column", "family", "--test-fraction", "0",
                             "--out", "o/b4"], "error"),
    ("cbm into its own concept dictionary", ["cbm", "q/concepts", "--label-column", "family", "--out",
                                             "q/concepts"], "error"),
    ("cbm on a dictionary, not concepts", ["cbm", "q/sae", "--label-column", "family", "--out", "o/b5"], "error"),
    ("export unknown format", ["export", "q/concepts", "--format", "nosuch", "--out", "o/e1"], "error"),
    ("export --cbm that is no CBM", ["export", "q/concepts", "--format", "html", "--cbm", "q/sae", "--out", "o/e2"],
     "error"),
    ("export --cbm of another concept dictionary", ["export", "q/concepts2", "--format", "html", "--cbm", "q/cbm",
                                                    "--out", "o/e3"], "error"),
    ("export a store to saelens", ["export", "q/store", "--format", "saelens", "--out", "o/e4"], "error"),
    ("export per-page 0", ["export", "q/concepts", "--format", "html", "--per-page", "0", "--out", "o/e5"], "error"),
    ("export into its own dictionary", ["export", "q/sae", "--format", "saelens", "--out", "q/sae/saelens"],
     "error"),
    ("show a latent beyond the dictionary", ["show", "q/concepts", "99999"], "error"),
    ("show a negative latent", ["show", "q/concepts", "-1"], "error"),
    ("show a dictionary, not concepts", ["show", "q/sae", "0"], "error"),
    ("store info missing", ["store", "info", "nowhere"], "error"),
    ("store verify a dictionary", ["store", "verify", "q/sae"], "error"),
    ("store import missing file", ["store", "import", "nowhere.npy", "--out", "o/s1"], "error"),
    ("store import a text file", ["store", "import", "notes.txt", "--out", "o/s2"], "error"),
    ("store import a 1-D array", ["store", "import", "one_d.npy", "--out", "o/s3"], "error"),
    ("store import a 3-D array", ["store", "import", "three_d.npy", "--out", "o/s4"], "ok"),  # flattened, warned
    ("store import big-endian floats", ["store", "import", "big_endian.npy", "--out", "o/s5"], "ok"),
    ("store import pickled objects", ["store", "import", "objects.npy", "--out", "o/s6"], "error"),
    ("store import a truncated .npy", ["store", "import", "truncated.npy", "--out", "o/s7"], "error"),
    ("store import a damaged safetensors", ["store", "import", "bad.safetensors", "--out", "o/s8"], "error"),
    ("store import integers", ["store", "import", "ints.npy", "--out", "o/s9"], "error"),
    ("cache missing local model", ["cache", "--model", "./nomodel", "--hookpoint", "sentence.mean", "--dataset",
                                   "stdlib-docstrings", "--tokens", "100", "--out", "o/k1"], "error"),
    ("cache missing local dataset", ["cache", "--model", "default", "--hookpoint", "sentence.mean", "--dataset",
                                     "./missing.txt", "--tokens", "100", "--out", "o/k2"], "error"),
    ("cache tokens 0", ["cache", "--model", "default", "--hookpoint", "sentence.mean", "--dataset",
                        "stdlib-docstrings", "--tokens", "0", "--out", "o/k3"], "error"),
    ("cache unknown hookpoint", ["cache", "--model", "default", "--hookpoint", "nosuch", "--dataset",
                                 "stdlib-docstrings", "--tokens", "100", "--out", "o/k4"], "error"),
    ("cache context-length 0", ["cache", "--model", "default", "--hookpoint", "sentence.mean", "--dataset",
                                "stdlib-docstrings", "--tokens", "100", "--context-length", "0", "--out", "o/k5"],
     "error"),
    ("cache blank text file", ["cache", "--model", "default", "--hookpoint", "sentence.mean", "--dataset",
                               "blank.txt", "--out", "o/k6"], "error"),
    ("steer an unknown latent", ["steer", "q/sae", "--latent", "99999", "--out", "o/p1"], "error"),
    ("erase unknown concept column", ["erase", "--store", "q/store", "--concept-column", "nosuch", "--out", "o/r1"],
     "error"),
    ("erase unknown method", ["erase", "--store", "q/store", "--concept-column", "family", "--method", "nosuch",
                              "--out", "o/r2"], "error"),
    ("erase ablate-latents 0", ["erase", "--store", "q/store", "--concept-column", "family", "--dictionary", "q/sae",
                                "--ablate-latents", "0", "--out", "o/r3"], "error"),
    ("erase into its own store", ["erase", "--store", "q/store", "--concept-column", "family", "--out",
                                  "q/store/erase"], "error"),
    ("steer alpha nan", ["steer", "q/sae", "--latent", "0", "--alpha", "nan", "--out", "o/p2"], "error"),
    ("score unknown scorer", ["score", "q/concepts", "--scorer", "nosuch"], "error"),
    ("cbsae without scores", ["cbsae", "q/concepts", "--label-column", "family", "--out", "o/x1"], "error"),
    ("compare the same dictionary twice", ["compare", "q/sae", "q/sae", "--store", "q/store", "--out", "o/c3"], "ok"),
    ("eval rows-from nosuch", ["eval", "q/sae", "--rows-from", "nosuch"], "error"),
    ("train --tokens as text", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--tokens", "many",
                                "--out", "o/t24"], "error"),
    ("train two stores of different rows as a crosscoder", ["train", "--store", "q/store", "--store", "o/s5",
                                                            "--kind", "crosscoder", "--latents", "16", "--k", "2",
                                                            "--out", "o/t25"], "error"),
    ("train into a store", ["train", "--store", "q/store", "--latents", "16", "--k", "2", "--out", "q/store"],
     "error"),
    ("name --namer unknown", ["name", "q/sae", "--namer", "nosuch", "--out", "o/n6"], "error"),
    ("name --namer llm with no server", ["name", "q/sae", "--namer", "llm", "--llm.url", "http://127.0.0.1:9",
                                         "--out", "o/n7"], "error"),
    ("show --sort unknown", ["show", "q/concepts", "--sort", "nosuch"], "error"),
    ("store info on a shard file", ["store", "info", "q/store/shard-00000.safetensors"], "error"),
    ("export json into a file path", ["export", "q/concepts", "--format", "json", "--out", "notes.txt"], "error"),
    ("diff one store", ["diff", "--store", "q/store", "--latents", "16", "--k", "2", "--out", "o/d1"], "error"),
    ("hookpoints of a missing model", ["hookpoints", "--model", "./nomodel"], "error"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "conceptdict-hostile")
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    build(args.work)
    wrong = 0
    print(f"| case | expect | exit | traceback | first error line |\n|---|---|---|---|---|")
    for name, argv, expect in CASES:
        if args.only not in name:
            continue
        done = run(argv, args.work)
        errors = [ln for ln in done.stderr.splitlines() if " error: " in ln or ln.startswith("usage:")]
        tb = "Traceback" in done.stderr
        line = (errors[-1] if errors else done.stderr.strip().splitlines()[-1:] or [""])
        line = line if isinstance(line, str) else line[0]
        good = (done.returncode == 0 and not tb) if expect == "ok" else (done.returncode != 0 and not tb)
        wrong += not good
        print(f"| {'' if good else '!! '}{name} | {expect} | {done.returncode} | {'yes' if tb else 'no'} | "
              f"{line[:160].replace('|', '/')} |", flush=True)
    print(f"\n{len(CASES)} cases, {wrong} not as expected")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
