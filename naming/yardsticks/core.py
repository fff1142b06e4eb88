"""core: SAEBench's core eval under its own names, from the numbers ``saes.evaluation.evaluate`` already computed
(``inputs.evaluation``, the rows ``eval`` reads: training's held-out batches by default).

Names and definitions (SAEBench 0.6.0 ``evals/core``):

- explained_variance: 1 - E||x - x_hat||^2 / (E||x||^2 - (mean of x^2 over all elements)^2), SAEBench's formula
  (``EvalResult.explained_variance_saebench``); explained_variance_textbook: 1 - FVU;
- mse: per element (SAEBench divides each row's squared error by its batch's token count: a batch-size dependent
  number, not reproduced);
- cossim, l2_ratio: means over rows; relative_reconstruction_bias: E||x_hat||^2 / E<x, x_hat> over all rows (SAEBench:
  per batch, then the mean of the batches: equal for one batch);
- ce_loss_score, kl_div_score and the raw losses: the dictionary spliced into the causal LM against zero ablation,
  where ``eval`` had a model and contexts;
- l0, l1: mean non-zero latents and mean sum of activations per row;
- frac_alive, freq_over_1_percent, freq_over_10_percent (SAEBench's "dense" is > 10%), their density-normalised
  forms, the density histogram (log10 bins), average_max_decoder_cosine_sim / average_max_encoder_cosine_sim.
"""

from __future__ import annotations

from typing import Any

import torch
from conceptdict.saes.compare import max_other_cosine
from conceptdict.saes.lazy import LazyDictionary
from conceptdict.saes.lazy_compare import max_other_cosines

SAEBENCH_TYPE = "core"


def compute(inputs) -> dict[str, Any]:
    """SAEBench core's numbers of ``inputs.evaluation`` (plus the weight-based ones from ``inputs.dictionary``;
a dictionary read lazily, block against block)."""
    r, sae = inputs.evaluation, inputs.dictionary
    density = torch.tensor(r.density, dtype=torch.float64)
    total = float(density.sum())
    s: dict[str, Any] = {}
    if r.splice:
        sp = r.splice
        s.update(kl_div_score=r.kl_score, kl_div_with_ablation=sp["kl_zero"], kl_div_with_sae=sp["kl_replaced"],
                 ce_loss_score=r.ce_loss_recovered, ce_loss_with_ablation=sp["ce_zero"],
                 ce_loss_with_sae=sp["ce_replaced"], ce_loss_without_sae=sp["ce_clean"])
    s.update(explained_variance=r.explained_variance_saebench, explained_variance_textbook=r.explained_variance,
             mse=r.mse, cossim=r.cos_sim, l2_ratio=r.l2_ratio, relative_reconstruction_bias=r.rel_recon_bias,
             l0=r.l0, l1=r.l1, frac_alive=float((density > 0).double().mean()),
             freq_over_1_percent=float((density > 0.01).double().mean()),
             freq_over_10_percent=float((density > 0.1).double().mean()),
             normalized_freq_over_1_percent=float(density[density > 0.01].sum()) / total if total else 0.0,
             normalized_freq_over_10_percent=float(density[density > 0.1].sum()) / total if total else 0.0,
             dead_fraction=r.dead_fraction, dense_fraction=r.dense_fraction, total_tokens=r.n_tokens)
    details: dict[str, Any] = {"density_histogram": list(r.density_histogram), "feature_density": list(r.density)}
    if sae.n_sources == 1 and not sae.spec.transcodes:
        if isinstance(sae, LazyDictionary):  # read a block of latents at a time: block against block
            dec, enc = max_other_cosines(sae), max_other_cosines(sae, "W_enc")
        else:
            dec = max_other_cosine(sae.W_dec.detach().float().cpu())[0] if sae.n_latents > 1 else torch.zeros(1)
            enc = max_other_cosine(sae.W_enc.detach().float().cpu().T)[0] if sae.n_latents > 1 else torch.zeros(1)
        s.update(average_max_encoder_cosine_sim=float(enc.mean()), average_max_decoder_cosine_sim=float(dec.mean()))
        details.update(max_decoder_cosine_sim=dec.tolist(), max_encoder_cosine_sim=enc.tolist())
    return {"summary": s, "details": details}


def saebench(result: dict[str, Any], about: dict[str, Any]) -> dict[str, Any]:
    """SAEBench's CoreEvalOutput layout: eval_result_metrics by category, one detail per latent."""
    s, d = result["summary"], result["details"]
    pick = lambda *keys: {k: s[k] for k in keys if s.get(k) is not None}
    metrics = {
        "model_behavior_preservation": pick("kl_div_score", "kl_div_with_ablation", "kl_div_with_sae"),
        "model_performance_preservation": pick("ce_loss_score", "ce_loss_with_ablation", "ce_loss_with_sae",
                                               "ce_loss_without_sae"),
        "reconstruction_quality": pick("explained_variance", "mse", "cossim"),
        "shrinkage": pick("l2_ratio", "relative_reconstruction_bias"),
        "sparsity": pick("l0", "l1"),
        "token_stats": {"total_tokens_eval_reconstruction": s["total_tokens"],
                        "total_tokens_eval_sparsity_variance": s["total_tokens"]},
        "misc_metrics": pick("freq_over_1_percent", "freq_over_10_percent", "normalized_freq_over_1_percent",
                             "normalized_freq_over_10_percent", "average_max_encoder_cosine_sim",
                             "average_max_decoder_cosine_sim", "frac_alive"),
    }
    details = [{"index": i, "feature_density": f,
                **({"max_decoder_cosine_sim": d["max_decoder_cosine_sim"][i],
                    "max_encoder_cosine_sim": d["max_encoder_cosine_sim"][i]} if "max_decoder_cosine_sim" in d
                   else {})} for i, f in enumerate(d["feature_density"])]
    return {"eval_type_id": SAEBENCH_TYPE, **about, "eval_result_metrics": {k: v for k, v in metrics.items() if v},
            "eval_result_details": details, "eval_result_unstructured": {"density_histogram": d["density_histogram"]}}
