"""Entry script for tests/test_lazy_capped.py (not collected by pytest): evaluate, export and (with ``vocab``) name a
block artifact in ONE process whose address space is capped below the artifact's size.

    python tests/lazy_capped.py SPEC.json

SPEC: ``artifact`` (a block artifact), ``warmup`` (a small one over the same store), ``store``, ``hookpoint``
(none for a CLT: its config names its layers' hookpoints), ``out`` (a folder), ``budget_mib``; optional ``export``
(the format, default saelens, which also exports as dictionary-learning with that export's resident peak measured
from its start; circuit-tracer for a CLT), optional ``compare_with`` ({"warmup": A, "big": B}:
``conceptdict compare`` runs too, of each artifact and its partner, on ``compare_rows`` rows, its resident peak measured from its start) and
``vocab`` (a word list) and ``cache`` (its embeddings cached for the
model id ``planted``): ``conceptdict name`` runs too, then (with the saelens export) ``conceptdict score`` of what it
named (with a scorer that needs no sentence encoder), each one's resident peak measured from its start. The process first evaluates and exports ``warmup``, whole and lazily (every
import, thread pool and kernel the measured run needs), reads its own VmSize, caps its address space at VmSize + budget
(``RLIMIT_AS``: it counts every mapping, so torch's own is in the baseline and only what the run adds is capped),
resets VmHWM (``/proc/self/clear_refs``), then evaluates and exports ``artifact``, and finally tries to load it
whole under the same cap. Prints one JSON line: the VmSize / VmRSS baseline, the cap, VmPeak and VmHWM after the
run, VmHWM after the eval (from the baseline) and export's and name's own (VmRSS at their start, VmHWM at their end:
VmHWM is reset as each starts), the times of eval, export and name, the eval's FVU and L0, and whether the whole
load failed.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MIB = 2 ** 20


def status(key: str) -> int:
    """Bytes of ``key`` (VmSize, VmRSS, VmHWM, VmPeak) in /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def run(spec: dict, artifact: str, tag: str) -> dict:
    import conceptdict as cd
    from conceptdict.cli.main import main

    out, fmt = Path(spec["out"]), spec.get("export", "saelens")
    where = {"hookpoint": spec["hookpoint"]} if spec.get("hookpoint") else {}  # a CLT's: from its config
    started = time.perf_counter()
    result = cd.evaluate(artifact, store=spec["store"], contexts=0, batch_size=spec.get("batch_size", 512),
                         out=out / f"{tag}-eval.json", **where)
    done = {"eval_vmhwm": status("VmHWM"), "eval_s": time.perf_counter() - started}
    Path("/proc/self/clear_refs").write_text("5")  # export's own resident peak from here
    done["export_base_rss"], started = status("VmRSS"), time.perf_counter()
    code = main(["export", artifact, "--format", fmt, "--out", str(out / f"{tag}-{fmt}")])
    done.update(fvu=result.metrics.fvu, l0=result.metrics.l0, export_exit=code, export_vmhwm=status("VmHWM"),
                export_s=time.perf_counter() - started)
    if fmt == "saelens":
        Path("/proc/self/clear_refs").write_text("5")  # export --format dictionary-learning's own peak from here
        done["dictlearn_base_rss"], started = status("VmRSS"), time.perf_counter()
        done["dictlearn_exit"] = main(["export", artifact, "--format", "dictionary-learning", "--out",
                                       str(out / f"{tag}-dictlearn")])
        done["dictlearn_vmhwm"], done["dictlearn_s"] = status("VmHWM"), time.perf_counter() - started
    del result  # its dictionary holds the block it read last
    if spec.get("vocab"):
        Path("/proc/self/clear_refs").write_text("5")  # name's own resident peak from here
        done["name_base_rss"], started = status("VmRSS"), time.perf_counter()
        done["name_exit"] = main(["name", artifact, "--vocab", spec["vocab"], "--model", "planted", "--cache-dir",
                                  spec["cache"], "--top-k", "3", "--n-bins", "4", "--chunk", "64", "--base-rows", "16",
                                  "--logit-tokens", "0", "--out", str(out / f"{tag}-named")])
        done["name_vmhwm"], done["name_s"] = status("VmHWM"), time.perf_counter() - started
        if fmt == "saelens":
            Path("/proc/self/clear_refs").write_text("5")  # score's own resident peak from here
            done["score_base_rss"], started = status("VmRSS"), time.perf_counter()
            done["score_exit"] = main(["score", str(out / f"{tag}-named"), "--scorer", "positive-share"])
            done["score_vmhwm"], done["score_s"] = status("VmHWM"), time.perf_counter() - started
    other = spec.get("compare_with", {}).get(tag)
    if other:
        Path("/proc/self/clear_refs").write_text("5")  # compare's own resident peak from here
        done["compare_base_rss"], started = status("VmRSS"), time.perf_counter()
        compared = cd.compare([artifact, other], store=spec["store"], contexts=0, rows=spec.get("compare_rows", 2048),
                              batch_size=spec.get("batch_size", 512), out=out / f"{tag}-compare")
        done["compare_vmhwm"], done["compare_s"] = status("VmHWM"), time.perf_counter() - started
        done["compare_json"] = str(compared.paths["json"])
    return done


def positive_share(ctx, names: dict) -> dict:
    """A scorer without a sentence encoder (``score``'s machinery measured, not an encoder's): the share of a
    latent's contexts that are its positives."""
    out = {}
    for j in names:
        if names[j] and j in ctx.samples:
            s = ctx.samples[j]
            out[j] = {"score": len(s.positives) / max(1, len(s.positives) + len(s.negatives))}
    return out


def warm_up(spec: dict) -> None:
    """The commands on the small artifact (which fits, so they load it whole), then the lazy route on it too (of a
    CLT, with ``export`` circuit-tracer: the commands again, read lazily)."""
    import torch
    from conceptdict.naming.scoring import register_scorer
    from conceptdict.saes import evaluate
    from conceptdict.saes.formats import dictlearn, saelens
    from conceptdict.saes.lazy import LAZY_ENV, open_lazy

    register_scorer("positive-share", positive_share)

    run(spec, spec["warmup"], "warmup")
    if spec.get("export", "saelens") != "saelens":
        os.environ[LAZY_ENV] = "1"
        run(spec, spec["warmup"], "warmup-lazy")
        del os.environ[LAZY_ENV]  # the measured run decides for itself
        return
    lazy = open_lazy(spec["warmup"])
    evaluate(lazy, [torch.randn(spec.get("batch_size", 512), lazy.d_in)])
    saelens.write(lazy, Path(spec["out"]) / "warmup-lazy")
    dictlearn.write(lazy, Path(spec["out"]) / "warmup-lazy-dictlearn")
    if spec.get("compare_with"):
        from conceptdict.saes import lazy_compare  # noqa: F401  (compare's block-against-block path)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    warm_up(spec)
    base_size, base_rss = status("VmSize"), status("VmRSS")
    cap = base_size + int(spec["budget_mib"] * MIB)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    measured = run(spec, spec["artifact"], "big")
    record = {"base_vmsize": base_size, "base_rss": base_rss, "cap": cap, "vmpeak": status("VmPeak"),
              "vmhwm": status("VmHWM"), **measured}
    try:
        import conceptdict as cd

        cd.load(spec["artifact"])
        record["whole_load"] = "loaded"
    except (MemoryError, RuntimeError) as e:
        record["whole_load"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
    print(json.dumps(record))


if __name__ == "__main__":
    main()
