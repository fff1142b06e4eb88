"""What ``train --eval-every N --metrics core,...`` measures at each evaluation (``saes.during`` runs it): the chosen
yardsticks (``naming.yardsticks``) of the dictionary as it stands, on the held-out rows of the run, with the store
the run reads (labels, true features) and, where a causal LM is at hand (a token store cached from one, or the model a
``train --model`` run reads), core's CE/KL score with the dictionary spliced in (the same splice as ``eval``).

Metrics whose inputs the run lacks are refused before any data is read, with the registry's one-line refusal."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

from conceptdict.activations import ActivationStore
from conceptdict.activations.live import FORWARD_LOCK, LiveConfig, LiveSource, level_of
from conceptdict.saes import EvalResult, SparseCoder, TrainConfig, kind_spec
from conceptdict.saes.during import Evaluator

DEFAULT_METRICS = ("core",)
"""What ``--eval-every`` measures when ``--metrics`` is left out."""


class Planned(NamedTuple):
    """What the registry's input checks read of a dictionary, before it exists: its kind and sources."""

    kind: str
    n_sources: int

    @property
    def spec(self):
        return kind_spec(self.kind)


def evaluator(cfg: TrainConfig, meta: dict[str, Any], live: LiveConfig | None = None,
              lm=None) -> Evaluator | None:
    """The evaluator of one dictionary of a run (None when it does not evaluate during training): ``meta`` is what
    its config.json records of its data (``stores``, ``hookpoints``); ``live`` and ``lm``: the model a ``train
    --model`` run reads. Refuses, before training, a metric whose inputs the run lacks."""
    if not cfg.eval_every:
        return None
    # imported here: only a run that evaluates needs the naming stage (the train command starts without it)
    from conceptdict.naming.yardsticks import check_named, parse_metrics

    names = parse_metrics(cfg.metrics or list(DEFAULT_METRICS))
    hookpoints = list(meta["hookpoints"])
    stores = [ActivationStore(p) for p in meta.get("stores") or []]
    source = LiveSource(live, lm, level_of(hookpoints)) if lm is not None else stores[0]
    store = stores[0] if stores else None
    sources = (len(stores) or 1) * len(hookpoints)
    check_named(names, Planned(cfg.kind, sources), store)  # type: ignore[arg-type]  # the checks read kind, sources
    return _Measure(names, source, store, hookpoints, cfg)


class _Measure:
    """An :data:`~conceptdict.saes.during.Evaluator`: the yardsticks ``names`` of a dictionary at a step; the spliced
    model's contexts are made at the first evaluation and kept."""

    def __init__(self, names: list[str], source, store: ActivationStore | None, hookpoints: list[str],
                 cfg: TrainConfig) -> None:
        from conceptdict.eval_api import EvalConfig
        from conceptdict.saes.config import resolve_device

        self.names, self.source, self.store, self.hookpoints = names, source, store, hookpoints
        self.device = str(resolve_device(cfg.device))
        self.cfg = EvalConfig(contexts=cfg.eval_contexts, device=self.device)
        self.splices = "core" in names and cfg.eval_contexts > 0
        self.lm_ids: tuple | None = None

    def __call__(self, sae: SparseCoder, result: EvalResult, step: int) -> dict[str, float]:
        from conceptdict.eval_api import lm_contexts, splice_scores
        from conceptdict.naming.yardsticks import Inputs, measure

        if self.splices:
            live = isinstance(self.source, LiveSource)
            with FORWARD_LOCK if live else contextlib.nullcontext():  # a live run's stream shares the model
                if self.lm_ids is None:
                    self.lm_ids = lm_contexts(self.source, self.cfg) or ()
                if self.lm_ids:
                    result = splice_scores(result, sae, self.source, self.hookpoints, self.cfg, self.lm_ids)
        sticks = measure(self.names, Inputs(sae, result, self.store, self.hookpoints[0], device=self.device))
        return sticks.flat()
