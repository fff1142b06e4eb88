"""``conceptdict erase``: erase (or switch) a labelled concept in a store's activations, every method on the
same split, one table.

Rows: the store's rows at one hookpoint with a concept column C (and optionally a target column Y), at most
``max_rows`` of them (a seeded subset), split once into fit and test rows. Each method is fitted on the fit
rows and applied to both:

- ``none``: the activations as they are (the "before" row);
- ``sae-ablation``: the ``ablate_latents`` dictionary latents a sparse (L1) probe on the latents ranks most
  predictive of C are set to zero, keeping the dictionary's error term: ``x' = x - sum_{j in S} f_j(x) d_j``;
- ``leace``, ``splince`` (needs Y), ``leace-switch``, ``midsteer``: the closed-form maps of
  :mod:`conceptdict.naming.interventions.erasure` (formulas there). MidSteer switches class ``switch_from`` to ``switch_to``
  (default: the most frequent concept class to the second).

Metrics per method, on the test rows: ``concept_linear_acc`` and ``concept_mlp_acc`` (fresh probes for C fitted on
the edited fit rows, :mod:`conceptdict.naming.bottleneck.probes`), ``concept_chance`` (majority-class rate),
``target_acc_before`` / ``target_acc_after`` (a fresh linear probe for Y), ``target_cov_change`` (relative
Frobenius change of Cov(x, one-hot Y); ``target_cov_change_fit`` on the fit rows, where SPLINCE keeps it
exactly), ``displacement`` (mean squared ||x' - x||^2), ``switch_rate`` for the steering methods (share of
source-class test rows that a probe fitted on the unedited rows now assigns to the target class), and
``ce_change`` (causal LMs: mean next-token CE with the map spliced in at the hookpoint minus without).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from conceptdict.naming.bottleneck.probes import ProbeConfig, linear_classifier, linear_probe, majority_rate, mlp_probe
from conceptdict.naming.reports.report import esc, page
from conceptdict.naming.bottleneck.solvers import fit_path
from conceptdict.naming.interventions.erasure import (
    Eraser,
    check_classes,
    cross_covariance,
    fit_leace,
    fit_leace_switch,
    fit_midsteer,
    fit_splince,
    load_eraser,
    one_hot,
    save_eraser,
)

log = logging.getLogger(__name__)

METHODS = ("none", "sae-ablation", "leace", "splince", "leace-switch", "midsteer")
STEERING = ("leace-switch", "midsteer")
Edit = Callable[[Tensor], Tensor]


@dataclass
class EraseConfig:
    """Flags of ``conceptdict erase``."""

    concept_column: str = field(default="", metadata={
        "help": "Label column of the store holding the concept C to erase."})
    target_column: str | None = field(default=None, metadata={
        "help": "Label column holding the target Y to keep (SPLINCE preserves Cov(x, Y); the Y metrics need it)."})
    hookpoint: str | None = field(default=None, metadata={"help": "Hookpoint of the store (default: its only one)."})
    dictionary: Path | None = field(default=None, metadata={
        "help": "Dictionary (or concept dictionary) for SAE ablation; without it that method is skipped."})
    methods: list[str] = field(default_factory=lambda: list(METHODS), metadata={"flag": "method",
        "help": "Methods to run (repeatable): none, sae-ablation, leace, splince, leace-switch, midsteer."})
    ablate_latents: int = field(default=8, metadata={
        "help": "Latents SAE ablation zeroes (the most predictive of C under an L1 probe on the latents)."})
    ablate_l1: float = field(default=1.0, metadata={
        "help": "L1 weight (on mean |W|) of the sparse probe that ranks the latents for SAE ablation."})
    switch_from: str | None = field(default=None, metadata={
        "help": "MidSteer's source class of C (default: the most frequent)."})
    switch_to: str | None = field(default=None, metadata={
        "help": "MidSteer's target class of C (default: the second most frequent)."})
    test_fraction: float = field(default=0.3, metadata={"help": "Share of the rows held out for every metric."})
    max_rows: int = field(default=20000, metadata={
        "help": "At most this many store rows (a seeded subset; token-level stores have many)."})
    min_class_size: int = field(default=5, metadata={"help": "Classes of C or Y with fewer rows are dropped (logged)."})
    model: str | None = field(default=None, metadata={
        "help": "Causal LM to splice each map into for the CE change (default: the store's model when it is one)."})
    contexts: int = field(default=16, metadata={
        "help": "Token contexts (rebuilt from the store) for the CE change; 0 skips it."})
    mlp_epochs: int = field(default=300, metadata={"help": "Epochs of the MLP probe (naming/bottleneck/probes.py)."})
    seed: int = field(default=0, metadata={"min": 0, "help": "Seed for the row subset, the split and the probes."})
    out: Path | None = field(default=None, metadata={
        "help": "Directory for erase.json, erase.html and the fitted erasers (erasers/METHOD/)."})
    device: str = field(default="cpu", metadata={"help": "Device for the dictionary and the model."})

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"unknown erasure method(s) {bad}; choose from {', '.join(METHODS)}")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction={self.test_fraction} must lie in (0, 1)")
        for name in ("ablate_latents", "max_rows", "min_class_size", "mlp_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("contexts", "ablate_l1"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")


# ---------------------------------------------------------------- data


class Labelled(NamedTuple):
    x: Tensor  # [N, D] float32
    concept: Tensor  # [N] int64
    concept_classes: tuple[str, ...]
    target: Tensor | None
    target_classes: tuple[str, ...]
    rows: Tensor  # [N] store row of each


def _column(store, name: str, what: str) -> list:
    values = store.labels(name)
    if values is None:
        keys = store.manifest.get("label_keys", [])
        raise ValueError(f"store {store.path} has no {what} column {name!r}; its label columns are "
                         f"{keys or 'none'}. Pass one of them, or cache a dataset carrying that column")
    return [None if v is None or str(v) == "" else str(v) for v in values]


def _classes(values: list, keep: Tensor, name: str, min_size: int) -> tuple[str, ...]:
    counts: dict[str, int] = {}
    for i in keep.tolist():
        counts[values[i]] = counts.get(values[i], 0) + 1
    classes = tuple(sorted(c for c, n in counts.items() if n >= min_size))
    if len(classes) < 2:
        raise ValueError(f"label column {name!r} has {len(counts)} value(s) {sorted(counts)[:5]} with >= {min_size} "
                         "rows; erasure needs a column with at least two classes")
    dropped = sorted(set(counts) - set(classes))
    if dropped:
        log.info("column %s: dropping %d classes with fewer than %d rows: %s", name, len(dropped), min_size,
                 dropped[:10])
    return classes


def load_labelled(store, hookpoint: str, cfg: EraseConfig) -> Labelled:
    """The rows of ``store`` at ``hookpoint`` with a concept (and target) label, as :class:`Labelled`."""
    if not cfg.concept_column:
        raise ValueError("no concept column: pass --concept-column COLUMN (a label column of the store)")
    concept = _column(store, cfg.concept_column, "concept")
    target = _column(store, cfg.target_column, "target") if cfg.target_column else None
    ok = [i for i, v in enumerate(concept) if v is not None and (target is None or target[i] is not None)]
    keep = torch.tensor(ok, dtype=torch.int64)
    if len(keep) > cfg.max_rows:
        pick = torch.randperm(len(keep), generator=torch.Generator().manual_seed(cfg.seed))[: cfg.max_rows]
        keep = keep[pick.sort().values]
    c_classes = _classes(concept, keep, cfg.concept_column, cfg.min_class_size)
    y_classes = _classes(target, keep, cfg.target_column, cfg.min_class_size) if target else ()
    keep = torch.tensor([i for i in keep.tolist() if concept[i] in c_classes
                         and (target is None or target[i] in y_classes)], dtype=torch.int64)
    c_index = {c: i for i, c in enumerate(c_classes)}
    c = torch.tensor([c_index[concept[i]] for i in keep.tolist()])
    y = None
    if target is not None:
        y_index = {v: i for i, v in enumerate(y_classes)}
        y = torch.tensor([y_index[target[i]] for i in keep.tolist()])
    x = _gather_rows(store, hookpoint, keep)
    return Labelled(x, c, c_classes, y, y_classes, keep)


def _gather_rows(store, hookpoint: str, rows: Tensor) -> Tensor:
    out, wanted = [], rows.tolist()
    pos = 0
    for start, chunk in store.iter_rows(hookpoint, 8192):
        stop = start + chunk.shape[0]
        take = []
        while pos < len(wanted) and wanted[pos] < stop:
            take.append(wanted[pos] - start)
            pos += 1
        if take:
            out.append(chunk[torch.tensor(take)].float())
        if pos == len(wanted):
            break
    return torch.cat(out)


# ---------------------------------------------------------------- SAE ablation


def ablation_latents(codes: Tensor, concept: Tensor, n_classes: int, n: int, l1: float) -> list[int]:
    """The ``n`` latents with the largest weights (max over classes, standardised codes) of an L1 logistic
    probe for the concept on the dictionary's codes [N, L]."""
    sd = codes.std(0)
    z = (codes - codes.mean(0)) / sd.clamp_min(1e-6)
    z[:, sd <= 1e-6] = 0
    fit = fit_path(z, concept, n_classes, bias=True, l1=[l1], max_iter=2000)[(l1, 0.0)]
    score = fit.weight.abs().amax(0)
    return score.topk(min(n, len(score))).indices.tolist()


def ablation_edit(dictionary, latents: list[int]) -> Edit:
    """x -> x - sum_{j in latents} f_j(x) d_j (the dictionary's error term kept)."""
    idx = torch.tensor(latents)

    def edit(x: Tensor) -> Tensor:
        with torch.no_grad():
            f = dictionary.encode(x.float().to(dictionary.device))
            delta = f[:, idx] @ dictionary.decoder_directions()[idx]
        return (x.float() - delta.to(x.device)).to(x.dtype)

    return edit


# ---------------------------------------------------------------- the table


def _rel_cov_change(x: Tensor, edited: Tensor, y: Tensor, k: int) -> float:
    before = cross_covariance(x, one_hot(y, k))
    return float((cross_covariance(edited, one_hot(y, k)) - before).norm() / before.norm().clamp_min(1e-30))


def _switch_classes(data: Labelled, cfg: EraseConfig) -> tuple[int, int]:
    counts = torch.bincount(data.concept, minlength=len(data.concept_classes))
    order = counts.argsort(descending=True).tolist()

    def index(value: str | None, default: int, flag: str) -> int:
        if value is None:
            return default
        if value not in data.concept_classes:
            raise ValueError(f"--{flag} {value!r} is not a class of concept column {cfg.concept_column!r}; "
                             f"its classes are {list(data.concept_classes)[:20]}")
        return data.concept_classes.index(value)

    return index(cfg.switch_from, order[0], "switch-from"), index(cfg.switch_to, order[1], "switch-to")


def fit_methods(data: Labelled, train: Tensor, cfg: EraseConfig, dictionary=None,
                names: list[str] | None = None) -> dict[str, tuple[Edit, Any, dict] | str]:
    """method -> (edit function, saved artifact or None, extra record fields), each fitted on the ``train`` rows;
    a method whose fit raises maps to the reason (``"skipped: ..."``) and the others still run."""
    x, c = data.x[train].double(), data.concept[train]
    out: dict[str, tuple[Edit, Any, dict] | str] = {}
    for method in cfg.methods:
        try:
            fitted = _fit(method, x, c, data, train, cfg, dictionary, names)
        except Exception as e:  # noqa: BLE001 - one method failing leaves its row, not the whole table
            kind = type(e).__name__.lstrip("_")
            reason = (str(e).strip().splitlines() or ["no message"])[0][:200]
            log.warning("erase: %s skipped: %s: %s", method, kind, reason)
            fitted = f"skipped: {kind}: {reason}"
        if fitted is not None:
            out[method] = fitted
    return out


def _fit(method: str, x: Tensor, c: Tensor, data: Labelled, train: Tensor, cfg: EraseConfig, dictionary,
         names: list[str] | None) -> tuple[Edit, Any, dict] | None:
    """One method fitted on the ``train`` rows (``x`` in float64, concept ``c``); None when it cannot run here."""
    if method == "none":
        return (lambda t: t, None, {})
    if method == "sae-ablation":
        if dictionary is None:
            log.info("sae-ablation skipped: no --dictionary")
            return None
        with torch.no_grad():
            codes = dictionary.encode(data.x[train].to(dictionary.device)).float().cpu()
        chosen = ablation_latents(codes, c, len(data.concept_classes), cfg.ablate_latents, cfg.ablate_l1)
        extra = {"latents": [{"id": j, "name": names[j] if names else ""} for j in chosen]}
        return (ablation_edit(dictionary, chosen), None, extra)
    if method == "splince":
        if data.target is None:
            log.info("splince skipped: it needs --target-column")
            return None
        return _closed(fit_splince(x, c, data.target[train]))
    if method == "leace":
        return _closed(fit_leace(x, c))
    if method == "leace-switch":
        return _closed(fit_leace_switch(x, c))
    source, target = _switch_classes(data, cfg)  # midsteer
    return _closed(fit_midsteer(x, c, source, target))


def _closed(eraser) -> tuple[Edit, Any, dict]:
    return eraser, eraser, {}


def _switch_rate(classify, steered: Tensor, pair: tuple[int, int], classes: tuple[str, ...]) -> dict[str, Any]:
    """Share of steered source-class rows that a probe fitted on the unedited rows assigns to the target class."""
    rate = float((classify(steered) == pair[1]).float().mean()) if len(steered) else float("nan")
    return {"switch_rate": rate, "switch": [classes[pair[0]], classes[pair[1]]]}


def erase_table(data: Labelled, cfg: EraseConfig, dictionary=None, names: list[str] | None = None,
                ce_change: Callable[[Edit], float] | None = None) -> tuple[dict[str, Any], dict[str, Eraser]]:
    """Fit every method on one split and measure it (see the module docstring). Returns the erase.json document
    and the fitted closed-form erasers by method."""
    check_classes(data.concept, f"concept column {cfg.concept_column!r}")
    n = len(data.concept)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed))
    n_test = max(2, round(cfg.test_fraction * n))
    test, train = perm[:n_test].sort().values, perm[n_test:].sort().values
    k = len(data.concept_classes)
    pcfg = ProbeConfig(mlp_epochs=cfg.mlp_epochs, seed=cfg.seed)
    c_tr, c_te = data.concept[train], data.concept[test]
    x_tr, x_te = data.x[train], data.x[test]
    y_tr = y_te = None
    target_before = None
    if data.target is not None:
        y_tr, y_te = data.target[train], data.target[test]
        target_before = linear_probe(x_tr, y_tr, x_te, y_te, len(data.target_classes), pcfg).accuracy
    classify = linear_classifier(x_tr, c_tr, k)
    switch = _switch_classes(data, cfg)
    records = []
    for method, fitted in fit_methods(data, train, cfg, dictionary, names).items():
        if isinstance(fitted, str):
            records.append(({"method": method, "skipped": fitted, **dict.fromkeys(COLUMNS)}, None))
            continue
        edit, artifact, extra = fitted
        log.info("erase: measuring %s", method)
        e_tr, e_te = edit(x_tr).float(), edit(x_te).float()
        rec: dict[str, Any] = {
            "method": method,
            "concept_linear_acc": linear_probe(e_tr, c_tr, e_te, c_te, k, pcfg).accuracy,
            "concept_mlp_acc": mlp_probe(e_tr, c_tr, e_te, c_te, k, pcfg).accuracy,
            "concept_chance": majority_rate(c_tr, c_te),
            "target_acc_before": target_before,
            "target_acc_after": None, "target_cov_change": None, "target_cov_change_fit": None,
            "displacement": float((e_te.double() - x_te.double()).square().sum(-1).mean()),
            "switch_rate": None, "ce_change": None, **extra,
        }
        if data.target is not None:
            m = len(data.target_classes)
            rec["target_acc_after"] = linear_probe(e_tr, y_tr, e_te, y_te, m, pcfg).accuracy
            rec["target_cov_change"] = _rel_cov_change(x_te, e_te, y_te, m)
            rec["target_cov_change_fit"] = _rel_cov_change(x_tr.double(), edit(x_tr.double()), y_tr, m)
        if method in STEERING:
            pair = (artifact.meta["source"], artifact.meta["target"]) if method == "midsteer" else switch
            if method == "midsteer" or k == 2:
                rec.update(_switch_rate(classify, e_te[c_te == pair[0]], pair, data.concept_classes))
        if ce_change is not None:
            rec["ce_change"] = ce_change(edit)
        records.append((rec, artifact))
    doc = {
        "concept_column": cfg.concept_column, "target_column": cfg.target_column,
        "concept_classes": list(data.concept_classes), "target_classes": list(data.target_classes),
        "n_train": len(train), "n_test": len(test), "records": [r for r, _ in records],
    }
    return doc, {r["method"]: a for r, a in records if a is not None}


# ---------------------------------------------------------------- CE change and output


def ce_change_function(model, store, hookpoint: str, contexts: int) -> Callable[[Edit], float]:
    """edit -> CE(edit spliced in at ``hookpoint``) - CE(clean) of a causal LM on contexts rebuilt from the store."""
    from conceptdict.activations import spliced_losses
    from conceptdict.activations.tokens import rebuild_contexts

    bos, pad = model.bos_pad_ids()
    ids, mask = rebuild_contexts(store, contexts, bos, pad)

    def change(edit: Edit) -> float:
        losses = spliced_losses(model, hookpoint, ids, lambda x: edit(x.cpu()).to(x.device), attention_mask=mask)
        return losses.ce_replaced - losses.ce_clean

    return change


COLUMNS = ("concept_linear_acc", "concept_mlp_acc", "concept_chance", "target_acc_before", "target_acc_after",
           "target_cov_change", "target_cov_change_fit", "displacement", "switch_rate", "ce_change")


def format_table(doc: dict[str, Any]) -> str:
    """The method x metric table as fixed-width text."""
    cols = [c for c in COLUMNS if any(r.get(c) is not None for r in doc["records"])]
    head = f"{'method':<14}" + "".join(f"{c:>22}" for c in cols)
    lines = [head]
    for r in doc["records"]:
        cells = "".join(f"{'-' if r.get(c) is None else format(r[c], '.4g'):>22}" for c in cols)
        lines.append(f"{r['method']:<14}" + (f"  {r['skipped']}" if r.get("skipped") else cells))
    return "\n".join(lines)


def write_erase(doc: dict[str, Any], erasers: dict[str, Eraser], out: Path, meta: dict[str, Any]) -> Path:
    """erase.json, erase.html and erasers/METHOD/ (the closed-form methods, with ``meta``) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for method, eraser in erasers.items():
        save_eraser(dataclasses.replace(eraser, meta={**eraser.meta, **meta}), out / "erasers" / method)
    doc = {**doc, "meta": meta}
    (out / "erase.json.tmp").write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(out / "erase.json.tmp", out / "erase.json")
    cols = [c for c in COLUMNS if any(r.get(c) is not None for r in doc["records"])]
    rows = "".join(
        "<tr><td>" + esc(r["method"]) + "</td>"
        + (f"<td colspan='{len(cols)}'>{esc(r['skipped'])}</td>" if r.get("skipped") else
           "".join(f"<td>{'&ndash;' if r.get(c) is None else esc(format(r[c], '.4g'))}</td>" for c in cols))
        + "<td>" + esc(", ".join(f"{a['id']} {a['name']}" for a in r.get("latents", []))) + "</td></tr>"
        for r in doc["records"])
    table = ("<table><tr><th>method</th>" + "".join(f"<th>{esc(c)}</th>" for c in cols)
             + "<th>latents</th></tr>" + rows + "</table>")
    header = (f"<h1>Erasure of {esc(doc['concept_column'])}</h1><div class='meta'>store {esc(meta.get('store'))} "
              f"[{esc(meta.get('hookpoint'))}], target {esc(doc['target_column'])}, {doc['n_train']} fit / "
              f"{doc['n_test']} test rows</div>")
    (out / "erase.html").write_text(page("conceptdict erase", header, table))
    return out / "erase.json"


def dictionary_at(path: Path, hookpoint: str, device: str):
    """(dictionary, latent names or None) for SAE ablation; refuses a dictionary trained at another hookpoint and
    crosscoders. ``path`` is a dictionary or a concept dictionary."""
    from conceptdict.naming.concepts import dictionary_of
    from conceptdict.saes import load_dictionary, load_dictionary_config, match_hookpoint

    ref = dictionary_of(path)
    config = load_dictionary_config(ref.path)
    recorded = [h for h in (config.get("hookpoints") or [config.get("hookpoint")]) if h]
    if recorded and not any(match_hookpoint(h, [hookpoint]) for h in recorded):
        raise ValueError(f"dictionary {ref.path} was trained at hookpoint {recorded[0]!r} but the store's is "
                         f"{hookpoint!r}; pass a dictionary of that hookpoint or the store it was trained on")
    model = load_dictionary(ref.path, device=device)
    if model.n_sources != 1:
        raise ValueError(f"dictionary {ref.path} is a crosscoder ({model.n_sources} sources); SAE ablation needs an SAE")
    return model, ref.names


def apply_eraser(eraser_dir: Path, store, hookpoint: str, out: Path) -> Path:
    """A new store at ``out``: ``store`` with the eraser saved at ``eraser_dir`` applied to ``hookpoint``."""
    from conceptdict.activations.transform import map_store

    eraser = load_eraser(eraser_dir)
    fitted_at = eraser.meta.get("hookpoint")
    if fitted_at and fitted_at != hookpoint:
        raise ValueError(f"eraser {eraser_dir} was fitted at hookpoint {fitted_at!r} but the store's is "
                         f"{hookpoint!r}; pass --hookpoint or an eraser fitted on this hookpoint")
    if eraser.mean.shape[0] != store.d_in(hookpoint):
        raise ValueError(f"eraser {eraser_dir} has D={eraser.mean.shape[0]} but {store.path} has "
                         f"D={store.d_in(hookpoint)} at {hookpoint}; pass the store it was fitted on")
    return map_store(store.path, out, hookpoint, eraser, note={"eraser": str(eraser_dir), "method": eraser.method})
