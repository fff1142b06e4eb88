"""sparse-probing: SAEBench's k-sparse probing on a labelled store.

For each label column and each of its :data:`MAX_CLASSES` most frequent classes (at least :data:`MIN_PER_CLASS`
inputs each), a binary task: the class's
inputs against as many from the other classes (drawn evenly from each, as SAEBench's ``prepare_probe_data``), on a
seeded train/test split of the inputs. An input is a context of a token store (its rows mean-pooled: the raw
activations' mean, and the mean of the dictionary's codes of its rows, as SAEBench pools) or a row of a sequence
store. For k in :data:`K_VALUES`, the k latents with the largest |mean difference| between the two classes on the
train split feed an L2 logistic probe (SAEBench's sklearn probe: C = 1, intercept not penalised, solved here to
convergence by L-BFGS in float64); its test accuracy is reported beside the same probe on the top-k raw dimensions
and on all raw dimensions and all latents. Accuracies are averaged over the tasks (SAEBench: over classes).

Differences from SAEBench, said: its all-dimensions probes are trained by Adam (100 epochs); here all probes are
the same L2 logistic regression. Its tasks come from fixed hub datasets; here from the store's own label columns.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
from conceptdict.naming.yardsticks import TooThin

SAEBENCH_TYPE = "sparse_probing"
K_VALUES = (1, 2, 5)
"""SAEBench's default k values."""
MIN_PER_CLASS = 8
MAX_CLASSES = 8
"""Classes probed per label column: the most frequent ones (SAEBench probes 5 to 8 chosen classes per dataset)."""
TRAIN_PER_CLASS = 4000
TEST_PER_CLASS = 1000
TEST_FRACTION = 0.2
CHUNK = 8192


def minimise(w: torch.Tensor, objective, max_iter: int = 1000) -> torch.Tensor:
    """``w`` (float64) moved by L-BFGS (strong Wolfe line search) to the minimum of the smooth ``objective(w)``."""
    w = w.detach().clone().requires_grad_(True)
    opt = torch.optim.LBFGS([w], lr=1, max_iter=max_iter, tolerance_grad=1e-6, tolerance_change=1e-10,
                            history_size=20, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        opt.zero_grad()
        value = objective(w)
        value.backward()
        return value

    with torch.enable_grad():
        opt.step(loss)
    return w.detach()


def fit_logistic(x_train: torch.Tensor, y_train: torch.Tensor, C: float = 1.0, max_iter: int = 1000,
                 weight: torch.Tensor | None = None) -> torch.Tensor:
    """sklearn's default logistic regression (L2, ``C``, unpenalised intercept), fit by L-BFGS in float64: the
    weights with the intercept last [D + 1]. ``weight``: each training row's weight (sklearn's sample weights;
    ``class_weight="balanced"`` is n / (2 n_class))."""
    x, y = x_train.double(), y_train.double()
    wt = None if weight is None else weight.double()
    return minimise(torch.zeros(x.shape[1] + 1, dtype=torch.float64), lambda w: C * torch.nn.functional.
                    binary_cross_entropy_with_logits(x @ w[:-1] + w[-1], y, weight=wt, reduction="sum") +
                    0.5 * w[:-1].pow(2).sum(), max_iter)


def probe_accuracy(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy of the probe ``w`` (intercept last) on rows ``x`` with labels ``y`` (1 positive)."""
    return float((((x.double() @ w[:-1] + w[-1]) > 0) == (y > 0)).double().mean())


def logistic_probe(x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                   C: float = 1.0, max_iter: int = 1000) -> float:
    """Test accuracy of :func:`fit_logistic` fit on the train split."""
    return probe_accuracy(fit_logistic(x_train, y_train, C, max_iter), x_test, y_test)


def top_k_dims(x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k dimensions of ``x`` with the largest |mean(positive) - mean(negative)| (SAEBench)."""
    diff = (x[y == 1].mean(0) - x[y == 0].mean(0)).abs()
    return torch.argsort(diff, descending=True)[:k]


def balanced_task(by_class: dict[Any, torch.Tensor], positive: Any, g: torch.Generator) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """(indices, labels) of one binary task: every input of ``positive`` and as many drawn evenly from the other
    classes (``by_class``: class -> input indices), shuffled; SAEBench's ``prepare_probe_data`` draw for draw."""
    pos = by_class[positive]
    others = [c for c in by_class if c != positive]
    per = math.ceil(len(pos) / len(others))
    neg = torch.cat([by_class[c][torch.randperm(len(by_class[c]), generator=g)[:per]] for c in others])
    neg = neg[torch.randperm(len(neg), generator=g)[:len(pos)]]
    pos = pos[:len(neg)]  # a class larger than all the others together: cut to the negatives (SAEBench asserts)
    idx = torch.cat([pos, neg])
    labels = torch.cat([torch.ones(len(pos), dtype=torch.long), torch.zeros(len(neg), dtype=torch.long)])
    order = torch.randperm(len(idx), generator=g)
    return idx[order], labels[order]


@torch.no_grad()
def pooled_inputs(inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(raw [n, D], codes [n, L], first row of each input [n]): the store's first ``inputs.rows`` rows grouped
    by context (a sequence store: one row each), raw rows and codes mean-pooled per context."""
    sae, store = inputs.dictionary, inputs.store
    n = min(inputs.rows, store.num_rows)
    raws, codes, ctxs = [], [], []
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        x = store.rows(inputs.hookpoint, a, b).to(sae.W_enc)
        raws.append(x.double().cpu())
        codes.append(sae.codes(sae.split(sae.flatten_batch(x))[0]).double().cpu())
        ctxs.append(store.context_index(a, b))
    ctx = torch.cat(ctxs)
    _, group = torch.unique_consecutive(ctx, return_inverse=True)
    m = int(group.max()) + 1
    count = torch.zeros(m, dtype=torch.float64).index_add_(0, group, torch.ones(len(group), dtype=torch.float64))
    pool = lambda t: torch.zeros(m, t.shape[1], dtype=torch.float64).index_add_(0, group, t) / count[:, None]
    first = torch.full((m,), len(group), dtype=torch.long).scatter_reduce_(0, group, torch.arange(len(group)), "amin")
    return pool(torch.cat(raws)), pool(torch.cat(codes)), first


def split(classes: list, values: list, g: torch.Generator) -> tuple[dict, dict]:
    """(train, test): class -> input indices, each class's inputs shuffled and cut at :data:`TEST_FRACTION`."""
    train, test = {}, {}
    for c in classes:
        idx = torch.tensor([i for i, v in enumerate(values) if v == c], dtype=torch.long)
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_test = max(1, round(len(idx) * TEST_FRACTION))
        test[c], train[c] = idx[:n_test][:TEST_PER_CLASS], idx[n_test:][:TRAIN_PER_CLASS]
    return train, test


def probe_scores(raw: torch.Tensor, codes: torch.Tensor, train: dict, test: dict, seed: int) -> dict[str, dict]:
    """score name -> {class: test accuracy} for every class of one column (the same draws for every probe)."""
    out: dict[str, dict] = {}

    def run(name: str, x: torch.Tensor, k: int | None) -> None:
        g = torch.Generator().manual_seed(seed)  # the same draws for every probe, as SAEBench's seeded runs
        for c in train:
            tr, ytr = balanced_task(train, c, g)
            te, yte = balanced_task(test, c, g)
            dims = top_k_dims(x[tr], ytr, k) if k else slice(None)
            out.setdefault(name, {})[str(c)] = logistic_probe(x[tr][:, dims], ytr, x[te][:, dims], yte)

    run("llm_test_accuracy", raw, None)
    for k in K_VALUES:
        run(f"llm_top_{k}_test_accuracy", raw, k)
    run("sae_test_accuracy", codes, None)
    for k in K_VALUES:
        run(f"sae_top_{k}_test_accuracy", codes, k)
    return out


def label_splits(inputs) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[dict, dict]]]:
    """(pooled raw inputs, pooled codes, column -> (train, test) class -> input indices) for every label column of
    ``inputs.store`` with two classes of at least :data:`MIN_PER_CLASS` inputs among its :data:`MAX_CLASSES` most
    frequent; refuses a store where no column has."""
    store = inputs.store
    raw, codes, first = pooled_inputs(inputs)
    splits = {}
    for key in store.manifest["label_keys"]:
        labels = store.labels(key)
        values = [labels[int(i)] for i in first]
        counts = Counter(v for v in values if v is not None)
        common = [c for c, n in sorted(counts.items(), key=lambda cn: (-cn[1], str(cn[0])))[:MAX_CLASSES]
                  if n >= MIN_PER_CLASS]
        if len(common) >= 2:
            splits[key] = split(sorted(common, key=str), values, torch.Generator().manual_seed(inputs.seed))
    if not splits:
        raise TooThin(f"no label column of {store.path} has two classes with at least {MIN_PER_CLASS} inputs "
                         f"each among the first {inputs.rows} rows; label more rows or pass a larger --rows")
    return raw, codes, splits


def compute(inputs) -> dict[str, Any]:
    """Sparse probing on every label column of ``inputs.store`` with at least two classes."""
    raw, codes, splits = label_splits(inputs)
    columns = {key: probe_scores(raw, codes, train, test, inputs.seed) for key, (train, test) in splits.items()}
    per_column = {key: {name: sum(acc.values()) / len(acc) for name, acc in scores.items()}
                  for key, scores in columns.items()}
    names = next(iter(per_column.values())).keys()
    summary = {name: sum(c[name] for c in per_column.values()) / len(per_column) for name in names}
    return {"summary": summary, "details": {"columns": per_column, "per_class": columns,
                                            "inputs": int(raw.shape[0]), "k_values": list(K_VALUES)}}


def saebench(result: dict[str, Any], about: dict[str, Any]) -> dict[str, Any]:
    """SAEBench's SparseProbingEvalOutput layout: llm / sae metric categories, one detail per label column."""
    s, d = result["summary"], result["details"]
    return {"eval_type_id": SAEBENCH_TYPE, **about,
            "eval_result_metrics": {"llm": {k: v for k, v in s.items() if k.startswith("llm_")},
                                    "sae": {k: v for k, v in s.items() if k.startswith("sae_")}},
            "eval_result_details": [{"dataset_name": f"{key}_results", **scores}
                                    for key, scores in d["columns"].items()],
            "eval_result_unstructured": {f"{key}_results": v for key, v in d["per_class"].items()}}
