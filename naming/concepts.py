"""The concept dictionary record and its on-disk format (DESIGN.md "Concept dictionary").

A directory holds ``concepts.json`` (format version, where the dictionary came from, one record per latent)
and ``concepts.safetensors`` (``directions [L, D]`` — or ``[L, S, D]`` for a crosscoder — the decoder rows in
raw activation units, plus ``frequency [L]``). The HTML report is written next to them by
:func:`conceptdict.naming.reports.report.write_report`.
"""

from __future__ import annotations

import dataclasses
import json
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from safetensors.torch import load_file
from torch import Tensor

if TYPE_CHECKING:
    import pandas

FORMAT_VERSION = 1
JSON_NAME = "concepts.json"
TENSORS_NAME = "concepts.safetensors"


@dataclass(frozen=True)
class Example:
    """One context where a latent fires: the text with the activating token marked."""

    row: int
    """Store row."""
    activation: float
    """The latent's activation on that row."""
    tokens: tuple[str, ...]
    """Context tokens (token-level stores) or the input's tokens (sequence-level)."""
    marked: int
    """Index into ``tokens`` of the activating token; -1 for a sequence-level row (the whole input)."""
    text: str
    """The context as plain text."""
    image: dict[str, Any] | None = None
    """Image stores: ``{"context": image index, "grid": [rows, cols] or None, "heat": per-patch activation
    scaled to 0..255 or None, "heat_max": its maximum}`` (``naming.images``); None for text."""

    def display_tokens(self) -> list[str]:
        """Tokens as they read in running text. When no decoded token carries a space of its own (WordPiece),
        pieces ``##x`` join the previous token and other tokens get a space (none before closing punctuation)."""
        return display_tokens(self.tokens)

    def marked_text(self, left: str = "<<", right: str = ">>") -> str:
        """The context with the activating token wrapped in ``left``/``right`` (the plain text when unmarked)."""
        if self.marked < 0 or not self.tokens:
            return self.text
        t = self.display_tokens()
        lead = t[self.marked][: len(t[self.marked]) - len(t[self.marked].lstrip(" "))]
        t[self.marked] = f"{lead}{left}{t[self.marked].lstrip(' ')}{right}"
        return "".join(t)


def display_tokens(tokens: Sequence[str]) -> list[str]:
    """See :meth:`Example.display_tokens`; GPT-2/SentencePiece-style tokens (with their own spaces) are kept."""
    toks = [str(t) for t in tokens]
    if len(toks) < 2 or any(t[:1].isspace() for t in toks):
        return toks
    out = []
    for i, t in enumerate(toks):
        if t.startswith("##"):
            out.append(t[2:])
        elif i == 0 or t[:1] in ".,;:!?)]}'" or out[-1][-1:] in "([{.'_":
            out.append(t)
        else:
            out.append(" " + t)
    return out


@dataclass(frozen=True)
class Concept:
    """A named latent with the evidence it was named from."""

    id: int
    """Latent index in the dictionary."""
    name: str
    """The chosen name ("" when unnamed)."""
    score: float
    """Naming score (vocabulary namer: cosine similarity; see each namer)."""
    runner_ups: tuple[str, ...] = ()
    """Next-best names, best first."""
    runner_up_scores: tuple[float, ...] = ()
    """Scores of ``runner_ups``."""
    namer: str = ""
    """Which namer chose the name."""
    frequency: float = 0.0
    """Fraction of store rows where the latent fires (activation > 0)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Activation statistics: max, mean (over all rows), mean_active, std_active, quantiles q10..q90."""
    histogram: dict[str, list[float]] = field(default_factory=dict)
    """``{"edges": [n+1], "counts": [n]}`` of the nonzero activations."""
    top_examples: tuple[Example, ...] = ()
    """Top-activating contexts, highest first."""
    quantile_examples: tuple[Example, ...] = ()
    """Contexts drawn from activation quantiles (lowest quantile first)."""
    logit_top: tuple[str, ...] = ()
    """Tokens most promoted by the direction (``W_dec[j] . W_U``), where the model has an unembedding."""
    logit_bottom: tuple[str, ...] = ()
    """Tokens most suppressed by the direction."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else (crosscoder flags such as relative norm and tag, LLM detection score, ...)."""
    scores: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Scorer -> metrics of the chosen name (``conceptdict score``; docs/scores.md), e.g.
    ``{"embedding": {"auroc": 0.81, "negatives": "random+hard", ...}}``."""
    names: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Namer -> ``{"name", "score", "scores"}``: every namer's name and its scores (namer agreement)."""
    confidence: float | None = None
    """How far the name can be trusted, in [0, 1], from namer agreement and scores (docs/scores.md)."""

    def __repr__(self) -> str:
        """One line: id, name, score, frequency, namer (the evidence is in the fields, and in :meth:`to_dict`)."""
        from conceptdict.saes.tables import shorten

        conf = "" if self.confidence is None else f", confidence={self.confidence:.3g}"
        return (f"Concept({self.id}, {shorten(self.name, 60)!r}, score={self.score:.4g}, "
                f"frequency={self.frequency:.4g}, namer={shorten(self.namer, 20)!r}{conf})")

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON types (concepts.json's record; examples also carry ``marked_text``)."""
        from conceptdict.saes.tables import plain

        return plain(concept_to_json(self))

    def row(self) -> dict[str, Any]:
        """The concept as one table row (:meth:`ConceptDictionary.to_pandas`): id, name, score, frequency, namer,
        confidence, runner-ups, and its stats, scores, namers' names and extra as ``stats.max``,
        ``scores.embedding.auroc``, ``names.vocab``, ... columns (no examples or histogram)."""
        return {"id": self.id, "name": self.name, "score": self.score, "frequency": self.frequency,
                "namer": self.namer, "confidence": self.confidence, "runner_ups": list(self.runner_ups),
                "stats": self.stats, "scores": self.scores,
                "names": {namer: v.get("name") for namer, v in self.names.items()}, "extra": self.extra}


@dataclass(frozen=True)
class ConceptDictionary:
    """All concepts of one dictionary, their directions and where they came from."""

    concepts: tuple[Concept, ...]
    """One per latent, ordered by id."""
    directions: Tensor
    """[L, D] (or [L, S, D] for a crosscoder): decoder rows in raw activation units."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Provenance: sae_dir, store, model, hookpoint, level, namer, vocabulary, ..."""
    path: Path | None = field(default=None, compare=False)
    """The folder it was written to or read from (None: in memory); API calls take it in its place."""

    def __post_init__(self) -> None:
        if self.directions.shape[0] != len(self.concepts):
            raise ValueError(
                f"{len(self.concepts)} concepts but directions has {self.directions.shape[0]} rows; "
                "pass one concept per decoder row"
            )
        for i, c in enumerate(self.concepts):
            if c.id != i:
                raise ValueError(f"concept at position {i} has id {c.id}; concepts must be ordered by id 0..L-1")

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.concepts]

    def __len__(self) -> int:
        return len(self.concepts)

    def __getitem__(self, key: int | str) -> Concept | list[Concept]:
        """``cd[12]``: the concept of latent 12; ``cd["error"]``: every concept named "error" (names may repeat)."""
        if isinstance(key, str):
            return [self.concepts[j] for j in self.ids_named(key)]
        if isinstance(key, slice):
            return self.concepts[key]
        try:
            key = operator.index(key)
        except TypeError:
            raise TypeError(f"concepts[{key!r}]: index by a latent id (an int) or a concept name (a str), "
                            f"not {type(key).__name__}") from None
        if not -len(self.concepts) <= key < len(self.concepts):
            raise IndexError(f"concepts[{key}]: no latent {key}; this dictionary has latents 0..{len(self) - 1} "
                             f"(len(concepts) is {len(self)})")
        return self.concepts[key]

    def __repr__(self) -> str:
        """One line: how many concepts (and named), the directions' shape, and where they came from."""
        from conceptdict.saes.tables import shorten

        named = sum(bool(c.name) for c in self.concepts)
        where = "".join(f", {key}={shorten(self.meta[key], width)!r}" for key, width in
                        (("namer", 12), ("hookpoint", 30), ("sae_dir", 30)) if self.meta.get(key))
        return (f"ConceptDictionary({len(self)} concepts ({named} named), directions "
                f"{list(self.directions.shape)}{where})")

    def to_dict(self, directions: bool = False) -> dict[str, Any]:
        """concepts.json's content as plain JSON types (meta, directions_shape, one record per concept); with
        ``directions``, also the directions as nested lists."""
        from conceptdict.saes.tables import plain

        out = {"meta": plain(self.meta), "directions_shape": list(self.directions.shape),
               "concepts": [c.to_dict() for c in self.concepts]}
        if directions:
            out["directions"] = plain(self.directions.detach().cpu())
        return out

    def to_pandas(self) -> pandas.DataFrame:
        """A DataFrame with one row per latent (:meth:`Concept.row`): id, name, score, frequency, namer,
        confidence, runner_ups, stats.*, scores.*, names.*, extra.*; e.g. ``df.sort_values("frequency")``."""
        from conceptdict.saes.tables import frame

        return frame([c.row() for c in self.concepts])

    def ids_named(self, name: str) -> list[int]:
        """Latent ids carrying ``name`` (names may repeat, as in Discover-then-Name)."""
        ids = [c.id for c in self.concepts if c.name == name]
        if not ids:
            close = sorted({c.name for c in self.concepts if name.lower() in c.name.lower()})[:5]
            hint = f"; similar names: {', '.join(close)}" if close else ""
            raise KeyError(f"no concept named {name!r}{hint}")
        return ids


def _example_to_json(e: Example) -> dict[str, Any]:
    d = dataclasses.asdict(e)
    d["tokens"] = list(e.tokens)
    d["marked_text"] = e.marked_text()
    if e.image is None:
        del d["image"]  # text examples keep their JSON as before
    return d


def _example_from_json(d: dict[str, Any]) -> Example:
    return Example(
        row=int(d["row"]),
        activation=float(d["activation"]),
        tokens=tuple(d.get("tokens", ())),
        marked=int(d.get("marked", -1)),
        text=str(d.get("text", "")),
        image=d.get("image"),
    )


def concept_to_json(c: Concept) -> dict[str, Any]:
    """A concept as plain JSON types (examples also carry ``marked_text``)."""
    d = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
    d["runner_ups"] = list(c.runner_ups)
    d["runner_up_scores"] = [float(s) for s in c.runner_up_scores]
    d["top_examples"] = [_example_to_json(e) for e in c.top_examples]
    d["quantile_examples"] = [_example_to_json(e) for e in c.quantile_examples]
    d["logit_top"] = list(c.logit_top)
    d["logit_bottom"] = list(c.logit_bottom)
    return d


def concept_from_json(d: dict[str, Any]) -> Concept:
    names = {f.name for f in dataclasses.fields(Concept)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"unknown concept fields {sorted(unknown)}; this file was written by a newer conceptdict")
    return Concept(
        id=int(d["id"]),
        name=str(d["name"]),
        score=float(d["score"]),
        runner_ups=tuple(d.get("runner_ups", ())),
        runner_up_scores=tuple(float(s) for s in d.get("runner_up_scores", ())),
        namer=str(d.get("namer", "")),
        frequency=float(d.get("frequency", 0.0)),
        stats={k: float(v) for k, v in d.get("stats", {}).items()},
        histogram={k: [float(x) for x in v] for k, v in d.get("histogram", {}).items()},
        top_examples=tuple(_example_from_json(e) for e in d.get("top_examples", ())),
        quantile_examples=tuple(_example_from_json(e) for e in d.get("quantile_examples", ())),
        logit_top=tuple(d.get("logit_top", ())),
        logit_bottom=tuple(d.get("logit_bottom", ())),
        extra=dict(d.get("extra", {})),
        scores={str(k): dict(v) for k, v in d.get("scores", {}).items()},
        names={str(k): dict(v) for k, v in d.get("names", {}).items()},
        confidence=None if d.get("confidence") is None else float(d["confidence"]),
    )


def save_concepts(cd: ConceptDictionary, directory: str | Path) -> Path:
    """Write ``concepts.json`` + ``concepts.safetensors`` into ``directory``; returns the directory (the writer of a
    block at a time, ``naming.written.ConceptsWriter``, given every concept at once)."""
    from .written import ConceptsWriter

    with ConceptsWriter(directory, len(cd.concepts), tuple(cd.directions.shape)) as out:
        out.add(cd.concepts, cd.directions.detach().cpu())
        return out.finish(cd.meta)


def load_concepts(directory: str | Path) -> ConceptDictionary:
    """Read a concept dictionary written by :func:`save_concepts`."""
    directory = Path(directory)
    jpath = directory / JSON_NAME
    if not jpath.exists():
        raise FileNotFoundError(
            f"{directory} has no {JSON_NAME}; pass a concept dictionary directory written by `conceptdict name`"
        )
    try:
        doc = json.loads(jpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{jpath} is not valid JSON ({e}); the concept dictionary is damaged: re-run `conceptdict "
                         "name`, or restore the file") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("concepts"), list):
        raise ValueError(f"{jpath} is not a concept dictionary (no 'concepts' list); re-run `conceptdict name`")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{jpath} has format_version={version!r}; this conceptdict reads version {FORMAT_VERSION}")
    tensors = load_file(str(directory / TENSORS_NAME))
    concepts = tuple(concept_from_json(c) for c in doc["concepts"])
    return ConceptDictionary(concepts=concepts, directions=tensors["directions"], meta=doc.get("meta", {}),
                             path=directory)


def is_concept_dir(directory: str | Path) -> bool:
    """True when ``directory`` holds a concept dictionary."""
    return (Path(directory) / JSON_NAME).exists()


class DictionaryRef(NamedTuple):
    """Where a dictionary lives, and its latents' names and the concept dictionary's ``meta`` when it was reached
    through a concept dictionary."""

    path: Path
    names: list[str] | None
    meta: dict[str, Any] | None


def dictionary_of(path: str | Path) -> DictionaryRef:
    """The dictionary behind ``path``: ``path`` itself when it is a dictionary directory (any format) or a hub id, or
    the ``sae_dir`` a concept dictionary records (with its names, read a block of concepts at a time: never the
    whole concepts.json in memory). The one resolver every command uses."""
    from .concepts_file import ConceptsFile

    if str(path).startswith("hf:") or not is_concept_dir(path):
        return DictionaryRef(Path(path) if not str(path).startswith("hf:") else path, None, None)
    file = ConceptsFile(path)
    sae_dir = file.meta.get("sae_dir")
    if not sae_dir:
        raise ValueError(f"concept dictionary {path} records no sae_dir; pass the dictionary directory instead")
    if not str(sae_dir).startswith("hf:") and not Path(sae_dir).exists():
        raise ValueError(f"concept dictionary {path} records sae_dir={sae_dir!r}, which does not exist; pass the "
                         f"dictionary directory instead")
    names = [c.name for block in file.concepts(4096) for c in block]
    return DictionaryRef(Path(sae_dir) if not str(sae_dir).startswith("hf:") else sae_dir, names, file.meta)
