"""Scores for names: does a latent's name predict where the latent fires? (``conceptdict score``)

A scorer is a function ``scorer(ctx: ScoringContext, names: {latent: name}) -> {latent: metrics}`` registered
in :data:`SCORERS` under its name. ``metrics`` is a JSON-able dict whose ``"score"`` is the headline number
(higher is better; 0.5 is chance for the AUROC and balanced-accuracy scorers) plus whatever else the scorer
measures. The results are stored per latent as ``Concept.scores[scorer_name]`` (docs/scores.md is the contract;
the steerability scorer plugs in as ``scores["steering"]``).

The ``embedding`` scorer (delphi's embedding scorer, offline): embed the name and the latent's contexts with a
sentence encoder (default the packaged MiniLM, mean-pooled and normalised) and rank the contexts by cosine to
the name; the score is the AUROC of "activating vs not" under that ranking, over the negatives the run asks for
(naming/negatives.py), also reported per kind of negative. With ``control`` on, every latent is also scored with
another latent's name (a random derangement): ``control_auroc`` should sit near 0.5, and a scorer whose
controls do not is measuring something other than the name.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .concepts import Concept, ConceptDictionary, Example
from .llm import LlmConfig
from .negatives import NegativeConfig, Sample

log = logging.getLogger(__name__)


@dataclass
class ScoreConfig:
    """Flags of ``conceptdict score``."""

    scorers: list[str] = field(default_factory=lambda: ["embedding"], metadata={"flag": "scorer",
        "help": "Scorers to run (repeat the flag): embedding, detection, fuzzing (and any registered one)."})
    namers: list[str] = field(default_factory=list, metadata={"flag": "namer",
        "help": ("Extra namers whose names are scored too (vocab, context, logit-lens, llm; repeat the flag); the "
                 "best-scoring name becomes the chosen one and the others its runner-ups.")})
    negatives: NegativeConfig = field(default_factory=NegativeConfig, metadata={
        "help": "Which negatives scores use (``--negatives.kinds random+hard`` ...)."})
    control: bool = field(default=True, metadata={
        "help": "Also score each latent with another latent's name (random-name control; should come out near 0.5)."})
    encoder: str = field(default="default", metadata={
        "help": "Sentence encoder for the embedding scorer and name agreement (default: the packaged MiniLM)."})
    encoder_hookpoint: str = field(default="sentence.mean_normalized", metadata={
        "help": "The encoder's hookpoint whose output embeds a text."})
    store: Path | None = field(default=None, metadata={
        "help": "Activation store for negatives (default: the one recorded in the concept dictionary)."})
    sae_dir: Path | None = field(default=None, metadata={
        "help": "Dictionary to check negatives with (default: the one recorded in the concept dictionary)."})
    vocab: str = field(default="wordfreq:en:20000", metadata={
        "help": "Vocabulary of the vocab namer, when it is one of --namer."})
    max_latents: int = field(default=0, metadata={
        "help": "Score at most this many firing latents, lowest ids first (0: all)."})
    batch_size: int = field(default=256, metadata={
        "help": "Texts embedded at once (short contexts: larger batches were ~2x faster on the demo's CPU)."})
    device: str = field(default="cpu", metadata={"help": "Device of the dictionary and the encoder."})
    seed: int = field(default=0, metadata={"min": 0, "help": "Seed of the control derangement."})
    llm: LlmConfig = field(default_factory=LlmConfig, metadata={
        "help": "Endpoint of the detection and fuzzing scorers and the llm namer (``--llm.url`` ...)."})

    def __post_init__(self) -> None:
        if isinstance(self.negatives, dict):
            self.negatives = NegativeConfig(**self.negatives)
        if isinstance(self.llm, dict):
            self.llm = LlmConfig(**self.llm)
        if self.max_latents < 0 or self.batch_size < 1:
            raise ValueError("max_latents >= 0 and batch_size >= 1 are required")


class TextEmbedder:
    """Unit sentence embeddings of texts, each text embedded once (memoised)."""

    def __init__(self, embed: Callable[[list[str]], Tensor]) -> None:
        self._embed = embed
        self._memo: dict[str, Tensor] = {}

    def forget(self) -> None:
        """Drop the memoised embeddings (scoring a block of latents at a time keeps memory flat)."""
        self._memo.clear()

    def __call__(self, texts: Sequence[str]) -> Tensor:
        todo = sorted({t for t in texts if t not in self._memo})
        if todo:
            vecs = self._embed(todo).float().cpu()
            vecs = vecs / vecs.norm(dim=1, keepdim=True).clamp_min(1e-12)
            self._memo.update(zip(todo, vecs))
        if not texts:
            return torch.zeros(0, 0)
        return torch.stack([self._memo[t] for t in texts])


def model_embedder(model: str, hookpoint: str, batch_size: int = 128, device: str = "cpu") -> TextEmbedder:
    """A :class:`TextEmbedder` over ``load_model(model)`` at ``hookpoint`` (loaded on first use)."""
    handle = []

    def embed(texts: list[str]) -> Tensor:
        from conceptdict.activations import embed_texts, load_model

        if not handle:
            handle.append(load_model(model, device=device))
        with torch.no_grad():
            return embed_texts(handle[0], texts, hookpoint, batch_size=batch_size)

    return TextEmbedder(embed)


@dataclass
class ScoringContext:
    """What every scorer may use. ``sources`` holds the dictionary, store and hookpoint when they could be
    opened (a steering scorer needs them); ``workdir`` is where a scorer keeps its caches."""

    cd: ConceptDictionary
    """The concept dictionary scored (``naming.score_run.score_in_place``, a block at a time: its meta only)."""
    samples: dict[int, Sample]
    """Per scored latent: positive contexts, negatives and the kind of each negative."""
    cfg: ScoreConfig
    embed: TextEmbedder
    sources: Any = None
    workdir: Path | None = None
    options: dict[str, Any] = field(default_factory=dict)
    """Scorer-specific settings (e.g. ``"llm"``: the LlmConfig of detection and fuzzing)."""
    controls: dict[int, str] | None = None
    """Per latent, the other latent's name it is also scored with (the random-name control, :func:`control_names`
    over every latent named, when ``samples`` holds a block of them); None: drawn over the names a scorer is given."""

    def context_vectors(self, examples: Sequence[Example]) -> Tensor:
        """[n, D] unit embeddings of the examples' texts. When the store's rows already are the encoder's
        sentence embeddings (a sequence-level store cached with the same encoder and hookpoint), the rows are
        read instead of embedding the text again."""
        if not examples:
            return torch.zeros(0, 0)
        if not rows_are_embeddings(self):
            return self.embed([e.text for e in examples])
        store, hp = self.sources.store, self.sources.hookpoint
        x = torch.cat([store.rows(hp, e.row, e.row + 1) for e in examples]).float()
        return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def rows_are_embeddings(ctx: ScoringContext) -> bool:
    """True when the store rows are the encoder's own text embeddings (see ``context_vectors``)."""
    src = ctx.sources
    return src is not None and store_rows_are(src.store, src.hookpoint, ctx.cfg.encoder, ctx.cfg.encoder_hookpoint)


def store_rows_are(store, hookpoint: str, encoder: str, encoder_hookpoint: str) -> bool:
    """True when ``store``'s rows at ``hookpoint`` are ``encoder``'s text embeddings at ``encoder_hookpoint`` (a
    sequence store cached with that encoder): a text's vector is then its row."""
    if getattr(store, "level", "") != "sequence" or hookpoint != encoder_hookpoint:
        return False
    return (store.manifest.get("config") or {}).get("model") == encoder


Scorer = Callable[[ScoringContext, dict[int, str]], dict[int, dict[str, Any]]]
SCORERS: dict[str, Scorer] = {}


def register_scorer(name: str, fn: Scorer) -> None:
    """Make ``fn`` available as ``conceptdict score --scorer NAME``."""
    SCORERS[name] = fn


def get_scorer(name: str) -> Scorer:
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; available: {', '.join(sorted(SCORERS))}")
    return SCORERS[name]


def auroc(pos: Sequence[float] | Tensor, neg: Sequence[float] | Tensor) -> float:
    """Area under the ROC curve of ``pos`` scored above ``neg`` (Mann-Whitney U / (n_pos n_neg), ties 1/2);
    NaN when either side is empty."""
    pos, neg = torch.as_tensor(pos, dtype=torch.float64), torch.as_tensor(neg, dtype=torch.float64)
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())


def derangement(ids: Sequence[int], seed: int) -> dict[int, int]:
    """Each id -> another id (a random cyclic shift of a shuffled order); identity for a single id."""
    order = list(ids)
    random.Random(seed).shuffle(order)
    return {a: order[(i + 1) % len(order)] for i, a in enumerate(order)}


def control_names(names: dict[int, str], seed: int) -> dict[int, str]:
    """Per named latent, another latent's name (a :func:`derangement` of the latents with a name); none for a single
    one."""
    other = derangement([j for j in names if names[j]], seed)
    return {j: names[o] for j, o in other.items() if o != j}


def _embedding_one(ctx: ScoringContext, name: str, sample: Sample) -> dict[str, Any]:
    sims = (ctx.context_vectors(sample.positives + sample.negatives) @ ctx.embed([name])[0]).tolist()
    pos, neg = sims[: len(sample.positives)], sims[len(sample.positives) :]
    hard = [s for s, k in zip(neg, sample.kinds) if k != "random"]
    rand = [s for s, k in zip(neg, sample.kinds) if k == "random"]
    return {"auroc": auroc(pos, neg), "auroc_random": auroc(pos, rand), "auroc_hard": auroc(pos, hard),
            "n_pos": len(pos), "n_random": len(rand), "n_hard": len(hard)}  # fmt: skip


def embedding_scorer(ctx: ScoringContext, names: dict[int, str]) -> dict[int, dict[str, Any]]:
    """AUROC of activating vs non-activating contexts ranked by cosine to the name (module docstring)."""
    named = [j for j in names if names[j] and j in ctx.samples]
    if not rows_are_embeddings(ctx):  # one batched pass over every context text
        ctx.embed([t.text for j in named for t in ctx.samples[j].positives + ctx.samples[j].negatives])
    ctx.embed([names[j] for j in named])
    controls = {} if not ctx.cfg.control else ctx.controls if ctx.controls is not None else \
        control_names({j: names[j] for j in named}, ctx.cfg.seed)
    out = {}
    for j in named:
        res = _embedding_one(ctx, names[j], ctx.samples[j])
        res = {"score": res["auroc"], **res, "negatives": ctx.cfg.negatives.kinds,
               "encoder": f"{ctx.cfg.encoder}:{ctx.cfg.encoder_hookpoint}"}  # fmt: skip
        if j in controls:
            res["control_name"] = controls[j]
            res["control_auroc"] = _embedding_one(ctx, controls[j], ctx.samples[j])["auroc"]
        out[j] = {k: _clean(v) for k, v in res.items()}
    return out


def _clean(v):
    return None if isinstance(v, float) and math.isnan(v) else v


register_scorer("embedding", embedding_scorer)


def quartiles(values: Sequence[float]) -> dict[str, float]:
    """{"n", "q25", "median", "q75"} of the finite values (NaN quantiles when there are none)."""
    v = torch.tensor([x for x in values if x is not None and math.isfinite(x)], dtype=torch.float64)
    if v.numel() == 0:
        return {"n": 0, "q25": float("nan"), "median": float("nan"), "q75": float("nan")}
    q = torch.quantile(v, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    return {"n": int(v.numel()), "q25": q[0], "median": q[1], "q75": q[2]}


def score_summary(cd: ConceptDictionary) -> dict[str, dict[str, dict[str, float]]]:
    """namer -> metric -> quartiles over latents: each scorer's ``score`` (as ``SCORER``) and, where present,
    the random-name control (``SCORER.control``) and the per-negative-kind AUROCs. ``(chosen)`` is the chosen
    name of each latent (the best-scoring namer's when several ran)."""
    return summary_of(summary_table(cd.concepts))


def summary_of(table: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """:func:`score_summary` of a :func:`summary_table`."""
    return {n: {k: quartiles(v) for k, v in sorted(m.items())} for n, m in table.items()}


def summary_table(concepts: Sequence[Concept], table: dict[str, dict[str, list[float]]] | None = None
                  ) -> dict[str, dict[str, list[float]]]:
    """namer -> metric -> each latent's value, of ``concepts`` added to ``table`` (a block at a time)."""
    table = {} if table is None else table
    for c in concepts:
        by_namer = {**{n: e.get("scores", {}) for n, e in c.names.items()}, "(chosen)": c.scores}
        for namer, scores in by_namer.items():
            for scorer, m in scores.items():
                for key, label in (("score", scorer), ("control_auroc", f"{scorer}.control"),
                                   ("auroc_random", f"{scorer}.random"), ("auroc_hard", f"{scorer}.hard")):  # fmt: skip
                    if m.get(key) is not None:
                        table.setdefault(namer, {}).setdefault(label, []).append(m[key])
    return table


def format_summary(summary: dict) -> str:
    """The score summary as a table: one line per namer and metric."""
    lines = [f"{'namer':12s} {'metric':22s} {'n':>6s} {'q25':>7s} {'median':>7s} {'q75':>7s}"]
    for namer, metrics in summary.items():
        for metric, q in metrics.items():
            lines.append(f"{namer:12s} {metric:22s} {q['n']:6d} {q['q25']:7.3f} {q['median']:7.3f} {q['q75']:7.3f}")
    return "\n".join(lines)
