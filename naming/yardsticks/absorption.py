"""absorption: SAEBench's first-letter feature absorption on a token hookpoint of a causal LM.

The task is the model's own vocabulary: every token that is letters after at most one leading space (SAEBench
``get_alpha_tokens``; at most :data:`MAX_WORDS` of them, a seeded sample), shuffled and split 80 / 20 into train and
test words. Each word is read in SAEBench's prompt: :data:`ICL_EXAMPLES` examples drawn from its own split
("{word} has the first letter: W", one a line, a newline first), then "{word} has the first letter:"; its activation
is the hookpoint's at the word's token. Then, as SAEBench's absorption eval:

1. a probe per first letter on the train words' activations (one-vs-rest logistic, positives weighted by
   negatives / positives, weight decay 1e-4: the objective SAEBench's Adam descends, minimised here to convergence
   by L-BFGS); its test F1 per letter (score > 0);
2. the main latents per letter (k-sparse probing): an L1-penalised one-vs-rest probe on the dictionary's codes of
   the train words (L1 0.01, minimised by proximal gradient, FISTA, where SAEBench runs Adam); for k = 1 ..
   :data:`MAX_K` a balanced logistic probe on the k latents with the largest weights, its test F1; the main
   latents are the k-th set while each k raises the F1 by more than :data:`F1_JUMP` (SAEBench's feature split);
3. on each test word of the letter that the probe finds (score > 0: the "probe true positives"), in a fresh prompt
   whose examples come from the whole vocabulary: the probe's unit direction p, the activation's projection
   a . p, each latent's projection code x cos(decoder row, p); the main latents' total m; the other latents with
   cos >= 0.1 and a positive projection, their top :data:`MAX_ABSORBERS` total t. Absorption fraction: 0 when
   m >= a . p or t < 0.4 a . p; 1 when m <= 0; else min(t, a . p - m) / (min(t, a . p - m) + m). Full absorption:
   no main latent fires, the top projecting latent has cos >= 0.025 and carries >= 0.4 of a . p;
4. per letter: the summed fractions and the full absorptions over the probe's true positives; averaged (and their
   sample standard deviations) over the letters whose probe has a test F1 above :data:`MIN_PROBE_F1`, which must be
   at least :data:`MIN_LETTERS` of them (else the hookpoint does not carry first letters well enough to say).

Differences from SAEBench, said: its probes are trained by Adam for a fixed number of epochs, here the same
objectives are minimised to convergence; its eval reads ``blocks.L.hook_resid_post`` of a TransformerLens model,
here the dictionary's own hookpoint of the model its store was cached from. The absorption arithmetic (step 3) and
the feature-split rule are checked against SAEBench's own functions (tests/test_yardstick_reference.py).
"""

from __future__ import annotations

import random
import statistics
from string import ascii_letters
from typing import Any

import torch
from conceptdict.naming.yardsticks import TooThin
from conceptdict.naming.yardsticks.sparse_probing import fit_logistic, minimise

SAEBENCH_TYPE = "absorption_first_letter"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TEMPLATE = "{word} has the first letter:"
ICL_EXAMPLES = 10
TRAIN_FRACTION = 0.8
MAX_WORDS = 4000
"""At most this many vocabulary words (a seeded sample): SAEBench reads them all (tens of thousands on a real LM)."""
PROBE_DECAY = 1e-4
L1_DECAY = 0.01
SPARSE_DECAY = 1e-6
MAX_K = 10
F1_JUMP = 0.03
MIN_PROBE_F1 = 0.6
MIN_LETTERS = 20
FULL_COS, FRACTION_COS, PROPORTION, MAX_ABSORBERS, TOP_FEATURES = 0.025, 0.1, 0.4, 3, 10
"""SAEBench's thresholds (feature_absorption.py) and the latents its full-absorption test looks at."""
EPS = 1e-8
BATCH = 32
FISTA_STEPS = 500


def alpha_words(tokenizer) -> list[str]:
    """Every token that reads as letters after at most one leading space (SAEBench ``get_alpha_tokens``, a
    SentencePiece word start counted as the space), in token id order."""
    out = []
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        word = tokenizer.convert_tokens_to_string([token])
        if token.startswith("\u2581") and not word.startswith(" "):
            word = " " + word
        bare = word.removeprefix(" ")
        if bare and all(c in ascii_letters for c in bare):
            out.append(word)
    return out


def letter_of(word: str) -> int:
    """The index in :data:`LETTERS` of the word's first letter."""
    return LETTERS.index(next(c for c in word if c.isalpha()).lower())


def prompt(word: str, examples: list[str], rng: random.Random) -> str:
    """SAEBench's ``create_icl_prompt``: :data:`ICL_EXAMPLES` other words of ``examples`` with their answers, then
    the word's own question, a newline before each."""
    drawn = [w for w in rng.sample(examples, min(len(examples), ICL_EXAMPLES + 1)) if w != word][:ICL_EXAMPLES]
    lines = [TEMPLATE.format(word=w) + " " + LETTERS[letter_of(w)].upper() for w in drawn]
    return "\n" + "\n".join(lines + [TEMPLATE.format(word=word)])


@torch.no_grad()
def word_activations(lm, hookpoint: str, prompts: list[str]) -> torch.Tensor:
    """[n, D] float64: the hookpoint's activation at each prompt's word: the last token of the prompt cut before
    the template's tail (the model's special prefix counted), so a tokenizer that marks word starts (SentencePiece)
    finds it as well as one that does not."""
    from conceptdict.activations.data import special_wrapping

    tail = len(TEMPLATE.split("{word}", 1)[1])
    prefix = len(special_wrapping(lm.tokenizer, prepend_bos=lm.is_causal)[0])
    out = []
    for i in range(0, len(prompts), BATCH):
        batch = prompts[i:i + BATCH]
        tokens = lm.to_tokens(batch, return_mask=True)
        at = torch.tensor([prefix + len(lm.tokenizer(p[:-tail], add_special_tokens=False)["input_ids"]) - 1
                           for p in batch])
        acts = lm.run_with_cache(tokens, names=[hookpoint]).cache[hookpoint]
        out.append(acts[torch.arange(len(at)), at].double().cpu())
    return torch.cat(out)


def one_vs_rest(y: torch.Tensor, letters: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets [n, C] 1/0 of each word for each letter, positive weights negatives / positives [C])."""
    targets = (y[:, None] == torch.tensor(letters)[None]).double()
    positives = targets.sum(0)
    return targets, (len(y) - positives) / positives


def letter_probe(x: torch.Tensor, y: torch.Tensor, letters: list[int]) -> torch.Tensor:
    """[C, D + 1] (intercept last): SAEBench's multi-probe objective (BCE with positive weights averaged over the
    words and the 26 letters, weight decay as an L2 term on weights and intercepts) at its minimum."""
    targets, pw = one_vs_rest(y, letters)
    xb = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.float64)], 1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def objective(w: torch.Tensor) -> torch.Tensor:
        w = w.view(len(letters), -1)
        return bce(xb @ w.T, targets, pos_weight=pw, reduction="sum") / (len(x) * 26) + \
            0.5 * PROBE_DECAY * w.pow(2).sum()

    return minimise(torch.zeros(len(letters) * xb.shape[1], dtype=torch.float64), objective).view(len(letters), -1)


def sparse_probe(codes: torch.Tensor, y: torch.Tensor, letters: list[int]) -> torch.Tensor:
    """[C, L] weights of SAEBench's L1-penalised multi-probe on the codes (BCE as :func:`letter_probe`, plus
    0.01 x each probe's L1 norm averaged over the 26 letters, decay 1e-6), by FISTA: its largest weights rank the
    latents per letter."""
    targets, pw = one_vs_rest(y, letters)
    x = codes.double().to_sparse()
    n, C = len(y), len(letters)
    forward = lambda w: torch.sparse.mm(x, w[:, :-1].T) + w[:, -1]  # [n, C]
    v = torch.ones(codes.shape[1] + 1, dtype=torch.float64)
    for _ in range(50):  # power iteration: the largest singular value of [codes, 1] bounds the gradient's change
        u = forward(v[None]).squeeze(1)
        v = torch.cat([torch.sparse.mm(x.t(), u[:, None]).squeeze(1), u.sum()[None]])
        v = v / v.norm().clamp_min(1e-30)
    lipschitz = 1.05 * float(forward(v[None]).norm()) ** 2 * float(pw.clamp_min(1).max()) / (4 * n * 26)
    step = 1 / (lipschitz + SPARSE_DECAY)
    w = torch.zeros(C, codes.shape[1] + 1, dtype=torch.float64)
    z, t = w.clone(), 1.0
    for _ in range(FISTA_STEPS):
        z.requires_grad_(True)
        with torch.enable_grad():
            smooth = torch.nn.functional.binary_cross_entropy_with_logits(forward(z), targets, pos_weight=pw,
                                                                          reduction="sum") / (n * 26)
            (grad,) = torch.autograd.grad(smooth + 0.5 * SPARSE_DECAY * z.pow(2).sum(), z)
        new = z.detach() - step * grad
        new[:, :-1] = new[:, :-1].sign() * (new[:, :-1].abs() - step * L1_DECAY / 26).clamp_min(0)
        t_new = (1 + (1 + 4 * t * t) ** 0.5) / 2
        z, w, t = new + (t - 1) / t_new * (new - w), new, t_new
    return w[:, :-1]


def f1(pred: torch.Tensor, truth: torch.Tensor) -> float:
    """F1 of boolean predictions (0 without a true positive, as sklearn's zero_division)."""
    tp = float((pred & truth).sum())
    return 2 * tp / (2 * tp + float((pred & ~truth).sum()) + float((~pred & truth).sum())) if tp else 0.0


def main_latents(ranked: torch.Tensor, train: torch.Tensor, y_train: torch.Tensor, test: torch.Tensor,
                 y_test: torch.Tensor) -> tuple[list[int], list[float]]:
    """(main latents, test F1 for k = 1 .. MAX_K) of one letter: balanced logistic probes on the top k of
    ``ranked`` latents, kept while each k raises the F1 by more than F1_JUMP (SAEBench
    ``add_feature_splits_to_metrics_df``)."""
    scores, best, chosen = [], -100.0, []
    n, pos = len(y_train), float(y_train.sum())
    balance = torch.where(y_train == 1, n / (2 * pos), n / (2 * (n - pos)))  # sklearn's class_weight="balanced"
    for k in range(1, min(MAX_K, len(ranked)) + 1):
        ids = ranked[:k]
        w = fit_logistic(train[:, ids], y_train, max_iter=500, weight=balance)
        scores.append(f1((test[:, ids].double() @ w[:-1] + w[-1]) > 0, y_test == 1))
    for k, score in enumerate(scores, 1):
        if score <= best + F1_JUMP:
            break
        best, chosen = score, ranked[:k].tolist()
    return chosen, scores


def absorption_of(acts: torch.Tensor, codes: torch.Tensor, direction: torch.Tensor, main: list[int],
                  decoder: torch.Tensor) -> tuple[list[float], list[bool]]:
    """(absorption fraction, full absorption) of each word (SAEBench ``FeatureAbsorptionCalculator``): ``acts``
    [n, D] at the words, ``codes`` [n, L], the probe ``direction`` [D], the letter's ``main`` latents."""
    p = direction.double() / direction.double().norm()
    cos = torch.nn.functional.cosine_similarity(p[None], decoder.double(), dim=-1)
    fractions, full = [], []
    for a, f in zip(acts.double(), codes.double()):
        total, proj = float(a @ p), f * cos
        m = float(proj[main].sum())
        others = torch.ones(len(proj), dtype=torch.bool)
        others[main] = False
        candidates = proj[others & (cos >= FRACTION_COS) & (proj > 0)]
        t = float(candidates.topk(min(MAX_ABSORBERS, len(candidates))).values.sum())
        if total <= 0 or m >= total or t / total < PROPORTION:
            fractions.append(0.0)
        elif m <= 0:
            fractions.append(1.0)
        else:
            absorbed = min(t, total - m)
            fractions.append(min(max(absorbed / (absorbed + m), 0.0), 1.0))
        top = int(proj.topk(min(TOP_FEATURES, len(proj))).indices[0])
        full.append(bool((f[main] < EPS).all()) and float(cos[top]) >= FULL_COS and total >= 0 and
                    float(proj[top]) / total >= PROPORTION if total else False)
    return fractions, full


def letter_result(fractions: list[float], full: list[bool], main: list[int]) -> dict[str, Any]:
    """One letter's numbers over its probe true positives (SAEBench ``_aggregate_results_df``)."""
    return {"mean_absorption_fraction": sum(fractions) / len(fractions), "full_absorption_rate": sum(full) / len(full),
            "num_full_absorption": sum(full), "num_probe_true_positives": len(fractions),
            "num_split_features": len(main)}


def summarise(per_letter: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The means and sample standard deviations over the letters (SAEBench's ``AbsorptionMeanMetrics``)."""
    series = {key: [v[key] for v in per_letter.values()] for key in ("mean_absorption_fraction",
                                                                     "full_absorption_rate", "num_split_features")}
    spread = lambda v: float(statistics.stdev(v)) if len(v) > 1 else 0.0
    return {"mean_absorption_fraction_score": float(statistics.mean(series["mean_absorption_fraction"])),
            "mean_full_absorption_score": float(statistics.mean(series["full_absorption_rate"])),
            "mean_num_split_features": float(statistics.mean(series["num_split_features"])),
            "std_dev_absorption_fraction_score": spread(series["mean_absorption_fraction"]),
            "std_dev_full_absorption_score": spread(series["full_absorption_rate"]),
            "std_dev_num_split_features": spread(series["num_split_features"])}


@torch.no_grad()
def encode(sae, x: torch.Tensor) -> torch.Tensor:
    """The dictionary's codes [n, L] (float32, on the CPU) of activations [n, D]."""
    return sae.codes(sae.split(sae.flatten_batch(x.to(sae.W_enc)))[0]).float().cpu()


def compute(inputs) -> dict[str, Any]:
    """Absorption of ``inputs.dictionary`` at its hookpoint of the causal LM its store was cached from."""
    from conceptdict.activations import load_model
    from conceptdict.activations.tokens import causal_lm_source

    sae, name = inputs.dictionary, causal_lm_source(inputs.store)
    lm = load_model(name, device=inputs.device)
    rng = random.Random(inputs.seed)
    words = alpha_words(lm.tokenizer)
    if len(words) > MAX_WORDS:
        words = sorted(rng.sample(words, MAX_WORDS), key=words.index)
    shuffled = rng.sample(words, len(words))
    cut = int(len(shuffled) * TRAIN_FRACTION)
    split = {"train": shuffled[:cut], "test": shuffled[cut:]}
    acts = {s: word_activations(lm, inputs.hookpoint, [prompt(w, ws, rng) for w in ws]) for s, ws in split.items()}
    y = {s: torch.tensor([letter_of(w) for w in ws]) for s, ws in split.items()}
    letters = sorted(set(y["train"].tolist()))
    probe = letter_probe(acts["train"], y["train"], letters)
    score = acts["test"] @ probe[:, :-1].T + probe[:, -1]
    probe_f1 = {c: f1(score[:, i] > 0, y["test"] == c) for i, c in enumerate(letters)}
    good = [c for c in letters if probe_f1[c] > MIN_PROBE_F1]
    if len(good) < MIN_LETTERS:
        raise TooThin(f"absorption: {len(good)} first letters have a probe test F1 above {MIN_PROBE_F1} at "
                         f"{inputs.hookpoint} of {name} ({len(words)} words; SAEBench needs {MIN_LETTERS}): this "
                         f"hookpoint does not carry first letters linearly, so absorption cannot be measured there")
    codes = {s: encode(sae, a) for s, a in acts.items()}
    ranking = sparse_probe(codes["train"], y["train"], letters)
    decoder = sae.decoder_directions().double().cpu()
    per_letter = {}
    for i, c in enumerate(letters):
        if c not in good:
            continue
        ranked = ranking[i].topk(min(MAX_K, ranking.shape[1])).indices
        main, k_f1 = main_latents(ranked, codes["train"], (y["train"] == c).long(), codes["test"],
                                  (y["test"] == c).long())
        found = [w for w, s, t in zip(split["test"], score[:, i].tolist(), y["test"].tolist()) if t == c and s > 0]
        if not found:
            continue
        a = word_activations(lm, inputs.hookpoint, [prompt(w, words, rng) for w in found])
        fractions, full = absorption_of(a, encode(sae, a), probe[i, :-1], main, decoder)
        per_letter[LETTERS[c]] = {**letter_result(fractions, full, main), "main_latents": main,
                                  "probe_f1": probe_f1[c], "k_sparse_f1": k_f1}
    return {"summary": summarise(per_letter), "details": {"letters": per_letter, "words": len(words), "model": str(name),
                                            "probe_f1": {LETTERS[c]: v for c, v in probe_f1.items()}}}


def saebench(result: dict[str, Any], about: dict[str, Any]) -> dict[str, Any]:
    """SAEBench's AbsorptionEvalOutput layout: the ``mean`` metrics (what its graphing reads), one detail per
    letter."""
    keys = ("mean_absorption_fraction", "full_absorption_rate", "num_full_absorption", "num_probe_true_positives",
            "num_split_features")
    return {"eval_type_id": SAEBENCH_TYPE, **about, "eval_result_metrics": {"mean": result["summary"]},
            "eval_result_details": [{"first_letter": letter, **{k: v[k] for k in keys}}
                                    for letter, v in result["details"]["letters"].items()],
            "eval_result_unstructured": None}
