"""``build_cbsae``: a scored concept dictionary + a user concept list -> a CB-SAE, its named and scored concept
dictionary, and the before/after numbers (naming/bottleneck/cbsae.py says what a CB-SAE is)."""

from __future__ import annotations

import dataclasses
import logging
import statistics
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from conceptdict.naming.bottleneck.cbm import CbmConfig, store_features, train_cbm
from conceptdict.naming.bottleneck.features import concept_directions
from conceptdict.naming.bottleneck.cbsae import (CbSae, CbSaeConfig, decode_with, fvu, lacking_concepts, prune_mask,
                                                 sim3, train_bottleneck)
from conceptdict.naming.concepts import ConceptDictionary
from conceptdict.naming.pipeline import NameConfig, Sources, TruncatingContextCache, name_dictionary
from conceptdict.naming.score_run import prepare_context, score_concepts
from conceptdict.naming.scoring import ScoreConfig, ScoringContext, TextEmbedder, auroc, model_embedder

log = logging.getLogger(__name__)


def read_concept_list(path: str | Path) -> list[str]:
    """One concept per line (blank lines and ``#`` comments skipped), each once."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"concept list {path} does not exist; pass a text file with one concept per line")
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line and line not in out:
            out.append(line)
    if not out:
        raise ValueError(f"concept list {path} holds no concepts; write one word or phrase per line")
    return out


def sample_rows(store, hookpoint: str, max_rows: int, seed: int, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(rows [N] ascending, x [N, D] float32): every row, or a uniform sample of ``max_rows`` plus the rows ``keep``."""
    n = store.num_rows
    rows = torch.arange(n) if n <= max_rows else torch.randperm(n, generator=torch.Generator().manual_seed(seed))[
        :max_rows].sort().values  # fmt: skip
    if keep is not None:
        rows = torch.unique(torch.cat([rows, keep.long()]))
    want = torch.zeros(n, dtype=torch.bool)
    want[rows] = True
    parts = [x[want[s : s + x.shape[0]]].float() for s, x in store.iter_rows(hookpoint, 8192)]
    return rows, torch.cat(parts)


def concept_targets(ctx: ScoringContext, store, rows: Tensor, concepts: Sequence[str]) -> Tensor:
    """[N, C] cosine between each row's text embedding and each concept's (the bottleneck's supervision)."""
    if not concepts:
        return torch.zeros(len(rows), 0)
    cache = TruncatingContextCache(store, 8, 4, 600)
    examples = [cache.example(int(r), 0.0) for r in rows.tolist()]
    vecs = torch.cat([ctx.context_vectors(examples[i : i + 4096]) for i in range(0, len(examples), 4096)])
    return vecs @ ctx.embed(list(concepts)).T


def _split(rows: Tensor, heldout: Tensor | None, seed: int, test_fraction: float = 0.2) -> tuple[Tensor, Tensor, str]:
    """(train positions, test positions, what the test rows are): the base dictionary's held-out rows when its
    training recorded them, else a random share of the sampled rows."""
    if heldout is not None:
        test = torch.isin(rows, heldout.long())
        return torch.nonzero(~test).flatten(), torch.nonzero(test).flatten(), \
            f"the base dictionary's {int(test.sum())} held-out rows"
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + 7))
    cut = int(len(rows) * (1 - test_fraction))
    return order[:cut], order[cut:], (f"a random {len(rows) - cut} of the sampled rows (the base dictionary records "
                                      f"no held-out rows for this store, so it may have trained on them)")


def interpretability(cd: ConceptDictionary, scorer: str) -> dict[str, float]:
    """Median, mean and count of the scorer's score over the scored latents, and the share of all latents
    at or above 0.7."""
    vals = [c.scores[scorer]["score"] for c in cd.concepts if c.scores.get(scorer, {}).get("score") is not None]
    return {"median": statistics.median(vals) if vals else float("nan"),
            "mean": statistics.fmean(vals) if vals else float("nan"), "n_scored": len(vals),
            "n_latents": len(cd.concepts), "share_ge_0.7": sum(v >= 0.7 for v in vals) / max(len(cd.concepts), 1)}


def _cbm_accuracy(model, store, hookpoint: str, names: list[str], label_column: str | None) -> float | None:
    if not label_column or store.labels(label_column) is None:
        return None
    cfg = CbmConfig(label_column=label_column)
    feats = store_features(model, store, hookpoint, label_column, codes=cfg.codes)
    directions = concept_directions(model, feats.raw.shape[1])
    return float(train_cbm(feats.concepts, feats.labels, names, cfg, raw=feats.raw,
                           directions=directions).metrics["accuracy"])


def build_cbsae(cd: ConceptDictionary, sources: Sources, user_concepts: Sequence[str], cfg: CbSaeConfig,
                embed: TextEmbedder | None = None, label_column: str | None = None,
                heldout: Tensor | None = None):  # fmt: skip
    """Prune, add the lacking concepts, train the bottleneck, name and score the result. ``heldout``: the store
    rows the base dictionary's training held out (``activations.heldout_row_ids``), the test rows of every FVU and
    alignment number (the bottleneck never trains on them). Returns (CbSae, its ConceptDictionary, summary dict)."""
    base, store, hp = sources.model, sources.store, sources.hookpoint
    mask, how = prune_mask(cd, cfg)
    keep = torch.nonzero(mask).flatten()
    interp = cfg.interpretability if cfg.interpretability == "embedding" else "embedding"
    # with steering scores on the input, the result is scored for steerability too (before / after)
    score_cfg = ScoreConfig(scorers=[interp] + (["steering"] if how["steerability"] else []))
    embed = embed or model_embedder(score_cfg.encoder, score_cfg.encoder_hookpoint, score_cfg.batch_size)
    ctx = ScoringContext(cd, {}, score_cfg, embed, sources)
    present, lacking = lacking_concepts(user_concepts, [cd.concepts[j].name for j in keep.tolist()], ctx.embed,
                                        cfg.match_cosine)  # fmt: skip
    rows, x = sample_rows(store, hp, cfg.max_rows, cfg.seed, keep=heldout)
    with torch.no_grad():
        f = base.encode(x)
        x_base, x_pruned = decode_with(base, f), decode_with(base, f * mask.float())
    targets = concept_targets(ctx, store, rows, lacking)
    train, test, test_rows = _split(rows, heldout, cfg.seed)
    bn = train_bottleneck(x[train], (x - x_pruned)[train], targets[train], cfg)
    model = CbSae(base, keep, bn.W_c, bn.b_c, bn.D_c, lacking, bn.theta)
    with torch.no_grad():
        c_test = model.bottleneck(x[test])
        x_cb = model(x[test])
    align = _alignment(c_test, targets[test], lacking)
    new_cd = _named(cd, model, sources, keep, lacking, align)
    scored = score_concepts(new_cd, score_cfg, prepare_context(new_cd, score_cfg, embed=ctx.embed, sources=Sources(
        model, store, hp, {})))  # fmt: skip
    names_before, names_after = [c.name for c in cd.concepts], [c.name for c in scored.concepts]
    summary = {
        "pruning": how, "n_latents_before": len(cd.concepts), "n_pruned": int((~mask).sum()), "n_kept": len(keep),
        "n_added": len(lacking), "added": lacking, "present": {k: [int(keep[i]) for i in v] for k, v in present.items()},
        "fvu": {"before": fvu(x[test], x_base[test]), "pruned": fvu(x[test], x_pruned[test]), "after": fvu(x[test], x_cb),
                "rows": test_rows},
        "interpretability": {"scorer": score_cfg.scorers[0], "before": interpretability(cd, score_cfg.scorers[0]),
                             "after": interpretability(scored, score_cfg.scorers[0])},
        "steerability": {"scorer": "steering", "before": interpretability(cd, "steering"),
                         "after": interpretability(scored, "steering")} if how["steerability"] else
        "not measured: the input has no steering scores (run `conceptdict score --scorer steering` first); "
        "pruning used interpretability only",
        "alignment_test": align, "train_loss": bn.history[-3:],
        "cbm_accuracy": {"before": _cbm_accuracy(base, store, hp, names_before, label_column),
                         "after": _cbm_accuracy(model, store, hp, names_after, label_column),
                         "label_column": label_column},
    }  # fmt: skip
    return model, scored, summary


def _alignment(c: Tensor, t: Tensor, concepts: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per added concept on held-out rows: cos-cubed similarity, Pearson correlation, and the AUROC of the
    bottleneck latent for the rows most similar to the concept (top 10% by target)."""
    out = {}
    s3 = sim3(c, t) if c.shape[1] else torch.zeros(0)
    for i, name in enumerate(concepts):
        ci, ti = c[:, i].double(), t[:, i].double()
        corr = float(torch.corrcoef(torch.stack([ci, ti]))[0, 1]) if ci.std() > 0 else 0.0
        top = ti >= ti.quantile(0.9)
        out[name] = {"sim3": float(s3[i]), "pearson": corr, "auroc_top10": auroc(ci[top], ci[~top])}
    return out


def _named(cd: ConceptDictionary, model: CbSae, sources: Sources, keep: Tensor, added: Sequence[str],
           align: dict) -> ConceptDictionary:  # fmt: skip
    """The CB-SAE's concept dictionary: fresh evidence, the kept latents' names, the added concepts' names."""
    fresh = name_dictionary(model, sources.store, NameConfig(namer="context", hookpoint=sources.hookpoint,
                                                             top_k=len(cd.concepts[0].top_examples) or 20))  # fmt: skip
    concepts = []
    for i, c in enumerate(fresh.concepts):
        if i < len(keep):
            old = cd.concepts[int(keep[i])]
            concepts.append(dataclasses.replace(c, name=old.name, score=old.score, namer=old.namer,
                                                runner_ups=old.runner_ups, runner_up_scores=old.runner_up_scores,
                                                extra={**c.extra, "base_latent": int(keep[i])}))  # fmt: skip
        else:
            name = added[i - len(keep)]
            concepts.append(dataclasses.replace(c, name=name, score=align[name]["sim3"], namer="cbsae-concept",
                                                runner_ups=(), runner_up_scores=(), extra={**c.extra, "bottleneck": True}))
    meta = {**cd.meta, "namer": "cbsae", "cbsae": {"base_concepts": cd.meta.get("sae_dir"), "added": list(added)}}
    return ConceptDictionary(tuple(concepts), fresh.directions, meta)


def summary_rows(s: dict[str, Any]) -> list[dict[str, Any]]:
    """The CB-SAE summary as table rows, one per measure, with its value before (the base dictionary), pruned (the
    kept latents alone, where measured) and after (the CB-SAE); an added concept's alignment has ``after`` only."""
    rows = [{"measure": "latents", "before": s["n_latents_before"], "pruned": s["n_kept"],
             "after": s["n_kept"] + s["n_added"]},
            {"measure": "fvu", "before": s["fvu"]["before"], "pruned": s["fvu"]["pruned"], "after": s["fvu"]["after"]}]
    for key in ("interpretability", "steerability"):
        if isinstance(s[key], dict):  # steerability: a sentence when not measured
            rows += [{"measure": f"{key} ({s[key]['scorer']}) {stat}", "before": s[key]["before"][stat],
                      "after": s[key]["after"][stat]} for stat in ("median", "mean", "share_ge_0.7")]
    cb = s["cbm_accuracy"]
    if cb["before"] is not None:
        rows.append({"measure": f"cbm accuracy ({cb['label_column']})", "before": cb["before"], "after": cb["after"]})
    rows += [{"measure": f"{concept} {stat}", "after": value} for concept, a in s["alignment_test"].items()
             for stat, value in a.items()]
    return rows


def _steer_line(st: Any) -> str:
    if isinstance(st, str):
        return f"steerability: {st}"
    b, a = st["before"], st["after"]
    return (f"steerability ({st['scorer']}): median {b['median']:.3f} -> {a['median']:.3f}, mean {b['mean']:.3f} -> "
            f"{a['mean']:.3f} ({b['n_scored']} -> {a['n_scored']} latents scored)")


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The CB-SAE summary as printable lines."""
    ib, ia = s["interpretability"]["before"], s["interpretability"]["after"]
    cb = s["cbm_accuracy"]
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    return [
        f"latents: {s['n_latents_before']} -> pruned {s['n_pruned']}, kept {s['n_kept']}, added {s['n_added']} "
        f"({', '.join(s['added']) or 'none'})",
        f"present already: {', '.join(f'{k} (#{v[0]})' for k, v in s['present'].items()) or 'none'}",
        f"interpretability ({s['interpretability']['scorer']}): median {ib['median']:.3f} -> {ia['median']:.3f}, "
        f"mean {ib['mean']:.3f} -> {ia['mean']:.3f}, share >= 0.7 {ib['share_ge_0.7']:.2f} -> {ia['share_ge_0.7']:.2f}",
        _steer_line(s["steerability"]),
        f"FVU on {s['fvu'].get('rows', 'held-out rows')}: {s['fvu']['before']:.4f} base, {s['fvu']['pruned']:.4f} "
        f"pruned, {s['fvu']['after']:.4f} CB-SAE",
        f"CBM accuracy ({cb['label_column']}): {pct(cb['before'])} -> {pct(cb['after'])}" if cb["before"] is not None
        else "CBM accuracy: not measured (pass --label-column COLUMN, a label column of the store)"
        if cb["label_column"] is None else f"CBM accuracy: not measured (the store has no label column "
                                           f"{cb['label_column']!r})",
    ] + [f"  {k}: sim3 {v['sim3']:.3f}, pearson {v['pearson']:.3f}, AUROC(top 10%) {v['auroc_top10']:.3f}"
         for k, v in s["alignment_test"].items()]  # fmt: skip
