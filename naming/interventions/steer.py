"""``conceptdict steer``: intervene on chosen dictionary latents at the dictionary's hookpoint.

With codes ``f = encode(x)`` and decoder rows ``d_j``, the dictionary's reconstruction is ``x_hat(f) = f W_dec +
b_dec``; an intervention changes the chosen codes to ``f'`` and keeps the error term ``x - x_hat(f)``, so only
the chosen latents change::

    x' = x_hat(f') + (x - x_hat(f)) = x + sum_j (f'_j - f_j) d_j

- ``add``:    f'_j = f_j + alpha        ->  x' = x + alpha sum_j d_j   (no encoding needed)
- ``clamp``:  f'_j = alpha
- ``ablate``: f'_j = 0

Causal LMs (:func:`steer_lm`): continuations of each prompt with and without the intervention (greedy, and
sampled with the same seed), and the log-probability shift of chosen tokens at the prompt's last position.
Sentence encoders (:func:`steer_sentences`): the steered embedding's cosine to given texts, against the same
shift by random directions of the same norm, and, with a CBM, the predicted classes before and after.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import torch
from torch import Tensor

from conceptdict.activations.intervene import (
    SentenceSteerer,
    edited_logits,
    encode_prompts,
    generate,
    steered_embeddings,
)
from conceptdict.naming.reports.report import esc, page

Edit = Callable[[Tensor], Tensor]


@dataclass
class SteerConfig:
    """Flags of ``conceptdict steer``."""

    latents: list[str] = field(default_factory=list, metadata={"flag": "latent",
        "help": "Latents to steer, by index or by name (repeatable; a name must match exactly one latent)."})
    mode: Literal["add", "clamp", "ablate"] = field(default="add", metadata={
        "help": "add alpha * d_j, clamp f_j to alpha, or ablate f_j (set it to 0); the error term is kept."})
    alpha: float = field(default=1.0, metadata={
        "help": ("The amount added (add) or the value clamped to (clamp), in the dictionary's code units: add mode "
                 "adds alpha * d_j with d_j the decoder row in raw activation units (steer.json records its norm; a "
                 "dictionary trained on normalised inputs has rows of norm 1 / scale, e.g. 0.051 for the demo's "
                 "sentence dictionary).")})
    prompts: list[str] = field(default_factory=list, metadata={"flag": "prompt",
        "help": ("Inputs to steer (repeatable): prompts to continue (causal LMs) or texts to embed (sentence "
                 "encoders).")})
    tokens: list[str] = field(default_factory=list, metadata={"flag": "token",
        "help": "Causal LMs: tokens whose log-probability shift at each prompt's last position is reported."})
    texts: list[str] = field(default_factory=list, metadata={"flag": "text",
        "help": "Sentence encoders: texts to compare the steered embeddings with (default: the latents' names)."})
    cbm: Path | None = field(default=None, metadata={
        "help": "Sentence encoders: a CBM (``conceptdict cbm``) whose predictions before and after are reported."})
    max_new_tokens: int = field(default=20, metadata={"help": "Causal LMs: tokens generated per continuation."})
    temperature: float = field(default=1.0, metadata={
        "help": "Causal LMs: temperature of the sampled continuation (the greedy one is always made too)."})
    random_directions: int = field(default=8, metadata={
        "help": "Random directions of the steering vector's norm that the sentence effect is compared with."})
    seed: int = field(default=0, metadata={"min": 0, "help": "Seed of the sampled continuations and the random directions."})
    model: str | None = field(default=None, metadata={
        "help": "Model to steer (default: the one recorded with the dictionary)."})
    out: Path | None = field(default=None, metadata={"help": "Directory for steer.json and steer.html."})
    device: str = "cpu"


def resolve_latents(specs: Sequence[str], names: Sequence[str] | None, n_latents: int) -> list[int]:
    """Latent ids for ``specs`` (ids or names); a name matching none or several latents is an error listing them."""
    if not specs:
        raise ValueError("no latent to steer: pass --latent ID_OR_NAME")
    out = []
    for spec in specs:
        if spec.lstrip("-").isdigit():
            j = int(spec)
            if not 0 <= j < n_latents:
                raise ValueError(f"latent {j} is out of range; the dictionary has latents 0..{n_latents - 1}")
            out.append(j)
            continue
        if names is None:
            raise ValueError(f"latent {spec!r} is not an index and the dictionary has no names; pass a concept "
                             "dictionary (`conceptdict name`) or an index")
        hits = [i for i, n in enumerate(names) if n == spec]
        if not hits:
            close = difflib.get_close_matches(spec, sorted(set(names)), n=5)
            raise ValueError(f"latent name {spec!r} matches no latent; closest names: {', '.join(close) or 'none'}")
        if len(hits) > 1:
            raise ValueError(f"latent name {spec!r} matches {len(hits)} latents ({', '.join(map(str, hits[:20]))}); "
                             "pass one of these ids with --latent")
        out.append(hits[0])
    return out


def latent_edit(dictionary, latents: Sequence[int], mode: str, alpha: float) -> Edit:
    """The intervention of the module docstring as a function of activations [n, D]."""
    idx = torch.tensor(list(latents))
    dirs = dictionary.decoder_directions()[idx].float().cpu()  # [m, D]
    if mode == "add":
        vector = alpha * dirs.sum(0)
        return lambda x: x + vector.to(x.device, x.dtype)
    if mode not in ("clamp", "ablate"):
        raise ValueError(f"steering mode {mode!r} is not one of add, clamp, ablate")

    def edit(x: Tensor) -> Tensor:
        with torch.no_grad():
            f = dictionary.encode(x.float().to(dictionary.device))[:, idx].cpu()
        new = torch.full_like(f, alpha) if mode == "clamp" else torch.zeros_like(f)
        return x + ((new - f) @ dirs).to(x.device, x.dtype)

    return edit


def random_direction(like: Tensor, seed: int) -> Tensor:
    """A random vector with the norm of ``like`` [D]."""
    r = torch.randn(like.shape, generator=torch.Generator().manual_seed(seed))
    return r / r.norm() * like.norm()


# ---------------------------------------------------------------- causal LMs


def token_ids(model, tokens: Sequence[str]) -> list[int]:
    """One id per token string (its first token; a leading space is kept as the tokenizer reads it)."""
    out = []
    for t in tokens:
        ids = model.tokenizer(t, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"--token {t!r} gives no token ids; pass a non-empty token")
        out.append(int(ids[0]))
    return out


def steer_lm(model, hookpoint: str, edit: Edit, cfg: SteerConfig) -> dict[str, Any]:
    """Continuations and chosen-token log-prob shifts with and without ``edit`` (see the module docstring)."""
    if not cfg.prompts:
        raise ValueError("no prompt: pass --prompt TEXT (repeatable)")
    ids, mask = encode_prompts(model, cfg.prompts)
    last = mask.sum(1) - 1
    rows = torch.arange(len(ids))
    before = edited_logits(model, ids, mask, hookpoint, None)[rows, last].log_softmax(-1)
    after = edited_logits(model, ids, mask, hookpoint, edit)[rows, last].log_softmax(-1)
    chosen = token_ids(model, cfg.tokens) if cfg.tokens else []
    prompts = []
    for i, prompt in enumerate(cfg.prompts):
        entry: dict[str, Any] = {"prompt": prompt, "tokens": {}}
        for tok, tid in zip(cfg.tokens, chosen):
            entry["tokens"][tok] = {"logprob_before": float(before[i, tid]), "logprob_after": float(after[i, tid]),
                                    "shift": float(after[i, tid] - before[i, tid])}
        for label, temp in (("greedy", 0.0), ("sampled", cfg.temperature)):
            for when, e in (("before", None), ("after", edit)):
                out = generate(model, prompt, hookpoint, e, cfg.max_new_tokens, temp, cfg.seed + i)
                entry[f"{label}_{when}"] = model.tokenizer.decode(out)
        entry["kl"] = float((before[i].exp() * (before[i] - after[i])).sum())
        prompts.append(entry)
    mean_shift = {tok: sum(p["tokens"][tok]["shift"] for p in prompts) / len(prompts) for tok in cfg.tokens}
    return {"kind": "causal-lm", "prompts": prompts, "mean_token_shift": mean_shift}


# ---------------------------------------------------------------- sentence encoders


def _cos(a: Tensor, b: Tensor) -> Tensor:
    """[N, M] cosines of rows of a [N, D] and b [M, D]."""
    return torch.nn.functional.normalize(a, dim=-1) @ torch.nn.functional.normalize(b, dim=-1).T


def steer_sentences(model, hookpoint: str, edit: Edit, vector: Tensor | None, texts: Sequence[str],
                    cfg: SteerConfig, dictionary=None, cbm=None) -> dict[str, Any]:
    """Cosine of the steered embeddings of ``cfg.prompts`` to ``texts``, against random directions of the norm of
    ``vector`` (the add-mode steering vector; None: no random control), and a CBM's predictions."""
    if not cfg.prompts:
        raise ValueError("no input texts: pass --prompt TEXT (repeatable) to embed and steer")
    steer = SentenceSteerer(model, cfg.prompts, hookpoint)
    base, steered = steer(None), steer(edit)
    goal = steered_embeddings(model, list(texts), hookpoint, None)
    shift = (_cos(steered, goal) - _cos(base, goal)).mean(0)  # [M]
    doc: dict[str, Any] = {
        "kind": "sentence", "texts": list(texts), "cos_shift": shift.tolist(),
        "mean_cos_shift": float(shift.mean()), "cos_to_original": float(torch.nn.functional.cosine_similarity(
            base, steered).mean()),
    }
    if vector is not None and cfg.random_directions:
        shifts = []
        for r in range(cfg.random_directions):
            rand = random_direction(vector, cfg.seed + 1000 + r)
            moved = steer(lambda x, v=rand: x + v.to(x.device, x.dtype))
            shifts.append(float((_cos(moved, goal) - _cos(base, goal)).mean()))
        control = sum(abs(s) for s in shifts) / len(shifts)
        doc.update(random_cos_shifts=shifts, random_abs_cos_shift=control,
                   ratio=doc["mean_cos_shift"] / control if control > 0 else None)
    if cbm is not None and dictionary is not None and hookpoint.startswith("sentence."):
        from conceptdict.activations.models import embed_texts

        raw = embed_texts(model, list(cfg.prompts), hookpoint)
        with torch.no_grad():
            pred = [cbm.logits(cbm.concepts_of(dictionary, e)).softmax(-1) for e in (raw, edit(raw))]
        doc["cbm"] = [{"prompt": p, "before": cbm.classes[int(a.argmax())], "after": cbm.classes[int(b.argmax())],
                       "p_before": float(a.max()), "p_after": float(b[a.argmax()])}
                      for p, a, b in zip(cfg.prompts, *pred)]
    return doc


# ---------------------------------------------------------------- output


def _shifts(tokens: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{t} {v['shift']:+.3f}" for t, v in tokens.items())


def write_steer(doc: dict[str, Any], out: Path) -> Path:
    """steer.json + steer.html under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "steer.json.tmp").write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(out / "steer.json.tmp", out / "steer.json")
    lat = ", ".join(f"{x['id']} {x['name']}" for x in doc["latents"])
    header = (f"<h1>Steering {esc(lat)}</h1><div class='meta'>{esc(doc['mode'])} alpha {esc(doc['alpha'])} at "
              f"{esc(doc['hookpoint'])} of {esc(doc['model'])}</div>")
    if doc["kind"] == "causal-lm":
        rows = "".join(
            f"<tr><td>{esc(p['prompt'])}</td><td>{esc(p['greedy_before'])}</td><td>{esc(p['greedy_after'])}</td>"
            f"<td>{esc(p['sampled_before'])}</td><td>{esc(p['sampled_after'])}</td>"
            f"<td>{esc(_shifts(p['tokens']))}</td></tr>"
            for p in doc["prompts"])
        body = ("<table><tr><th>prompt</th><th>greedy</th><th>greedy, steered</th><th>sampled</th>"
                f"<th>sampled, steered</th><th>log-prob shift</th></tr>{rows}</table>")
    else:
        rows = "".join(f"<tr><td>{esc(t)}</td><td>{s:+.4f}</td></tr>" for t, s in zip(doc["texts"], doc["cos_shift"]))
        body = f"<table><tr><th>text</th><th>cosine shift</th></tr>{rows}</table>"
        if doc.get("ratio") is not None:
            body += (f"<p>mean shift {doc['mean_cos_shift']:+.4f}; random directions of the same norm "
                     f"{doc['random_abs_cos_shift']:.4f} (mean |shift|); ratio {doc['ratio']:.2f}</p>")
        if doc.get("cbm"):
            body += "<table><tr><th>input</th><th>CBM before</th><th>after</th></tr>" + "".join(
                f"<tr><td>{esc(c['prompt'])}</td><td>{esc(c['before'])}</td><td>{esc(c['after'])}</td></tr>"
                for c in doc["cbm"]) + "</table>"
    (out / "steer.html").write_text(page("conceptdict steer", header, body))
    return out / "steer.json"


def steer_model_name(given: str | None, config: dict) -> str:
    """The model to steer: ``given``, else the one the dictionary records (its directory when it still exists)."""
    if given:
        return given
    info = config.get("model") or {}
    source = info.get("source") if isinstance(info, dict) else None
    name = source if source and Path(source).is_dir() else (info.get("id") if isinstance(info, dict) else info)
    if not name:
        raise ValueError("the dictionary records no model; pass --model NAME_OR_DIR")
    return name


def steer_document(model, hookpoint: str, dictionary, latents: list[int], names: list[str] | None,
                   cfg: SteerConfig, cbm=None, source: str = "") -> dict[str, Any]:
    """Steer ``model`` at ``hookpoint`` through ``latents`` of ``dictionary`` as ``cfg`` says: continuations and
    log-prob shifts for a causal LM at a token hookpoint, cosine shifts against texts (and a CBM's predictions)
    for a sentence encoder; the steer.json document, with each latent's decoder norm."""
    from conceptdict.activations import SENTENCE_HOOKPOINTS

    if hookpoint not in model.hookpoints:
        raise ValueError(f"dictionary {source} was trained at hookpoint {hookpoint!r}, which model {model.name} does "
                         "not have; pass the model it was trained on with --model")
    if model.d_model(hookpoint) != dictionary.d_in:
        raise ValueError(f"dictionary d_in={dictionary.d_in} but {model.name} has D={model.d_model(hookpoint)} at "
                         f"{hookpoint}; pass the model the dictionary was trained on")
    edit = latent_edit(dictionary, latents, cfg.mode, cfg.alpha)
    directions = dictionary.decoder_directions()[latents].float()
    if model.is_causal and hookpoint not in SENTENCE_HOOKPOINTS:
        doc = steer_lm(model, hookpoint, edit, cfg)
    else:
        texts = cfg.texts or [names[j] for j in latents if names and names[j]]
        if not texts:
            raise ValueError("no texts to compare with: pass --text TEXT, or steer named latents")
        vector = cfg.alpha * directions.sum(0).cpu() if cfg.mode == "add" else None
        doc = steer_sentences(model, hookpoint, edit, vector, texts, cfg, dictionary, cbm)
    doc.update(latents=[{"id": j, "name": names[j] if names else "", "decoder_norm": n}
                        for j, n in zip(latents, directions.norm(dim=-1).tolist())],
               mode=cfg.mode, alpha=cfg.alpha, hookpoint=hookpoint, model=model.name, dictionary=source)
    return doc


def dictionary_edit(dictionary, edit=None) -> Edit:
    """The function of activations [n, D] that splices ``dictionary`` in: ``edit`` None replaces x by its
    reconstruction; a dict {latent: value} clamps those latents' codes to value (0 ablates) and
    {latent: ("add", a)} adds a * d_j, keeping the error term x - x_hat; a callable maps codes [n, L] to new codes,
    also keeping the error term."""
    if edit is None:
        def reconstruct(x: Tensor) -> Tensor:
            with torch.no_grad():
                return dictionary(x.to(dictionary.device)).to(x.device)
        return reconstruct
    if callable(edit):
        def recode(x: Tensor) -> Tensor:
            with torch.no_grad():
                f = dictionary.encode(x.to(dictionary.device))
                delta = dictionary.decode(edit(f.clone())) - dictionary.decode(f)
            return x + delta.to(x.device, x.dtype)
        return recode
    if not isinstance(edit, Mapping):
        raise TypeError(f"edit={edit!r} is not an edit: pass None (the reconstruction), {{latent: value}} to clamp "
                        "(0 ablates), {latent: ('add', a)} to add a * d_j, or a function of the codes [n, L]")
    try:
        ids = resolve_latents([str(j) for j in edit], None, dictionary.n_latents) if edit else []
    except ValueError as e:
        raise ValueError(f"edit={edit!r}: {e}") from None
    adds, clamps = {}, {}
    for j, v in zip(ids, edit.values()):
        is_add = isinstance(v, (tuple, list)) and len(v) == 2 and v[0] == "add"
        if (isinstance(v, (tuple, list)) and not is_add) or not _is_number(v[1] if is_add else v):
            raise ValueError(f"edit of latent {j}: {v!r} is not a value; write {{latent: value}} to clamp (0 "
                             "ablates) or {latent: ('add', a)}")
        (adds if is_add else clamps)[j] = float(v[1] if is_add else v)

    def change(f: Tensor) -> Tensor:
        for j, value in clamps.items():
            f[:, j] = value
        return f

    vector = sum((a * dictionary.decoder_directions()[j].float() for j, a in adds.items()),
                 torch.zeros(dictionary.d_in, device=dictionary.device))
    clamp = dictionary_edit(dictionary, change) if clamps else None

    def apply(x: Tensor) -> Tensor:
        y = clamp(x) if clamp is not None else x
        return y + vector.to(y.device, y.dtype)

    return apply


def _is_number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return not isinstance(v, (str, bytes))
