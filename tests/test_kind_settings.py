"""Kinds own their settings (saes/kinds/): the flat names every config, flag and old file uses map onto TrainConfig's
shared fields plus the chosen kind's settings, and back."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conceptdict import saes
from conceptdict.saes.config import calibration_batch_count
from conceptdict.saes.flat import sweep_configs
from conceptdict.saes.flat import flat_for_kind
from conceptdict.saes.kinds.jumprelu import JumpReLUSettings
from conceptdict.saes.kinds.matryoshka import MatryoshkaSettings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

OLD_FIELDS = [
    "latents", "k", "kind", "tokens", "batch_size", "lr", "warmup_steps", "decay_fraction", "grad_clip", "normalize",
    "b_dec_init", "init_rows", "aux_k", "aux_alpha", "dead_tokens", "l1_coeff", "code_l1", "topk_start", "l0_coeff",
    "jumprelu_penalty", "jumprelu_bandwidth", "sparsity_warmup_steps", "matryoshka_groups", "matryoshka_inner_weight",
    "spade_coeff", "threshold_start_step", "threshold_momentum", "calibration_batches", "eval_batches", "seed",
    "checkpoint_every", "log_every", "kernel_impl", "device", "d_in"]
"""TrainConfig's fields before the kinds owned their settings: every one is still a flat name."""
ADDED_FIELDS = ["log", "stop_patience", "stop_threshold", "stop_every", "precision", "latent_shards",
                "single_file_gib", "eval_every", "metrics", "eval_contexts"]
"""Flat names added since (``log``: the optional metrics tracker, saes/metrics.py; ``stop_*``: the stopping rule,
saes/stopping.py; ``precision``: the encoder matmul's dtype, saes/config.py; ``latent_shards``: the latents split
over processes, saes/distributed.py; ``single_file_gib``: above it a sharded run saves one file per shard,
saes/shards.py; ``eval_every``, ``metrics``, ``eval_contexts``: evaluation during training, saes/during.py)."""


def test_every_former_field_is_a_flat_name_with_short_help():
    fields = saes.flat_train_fields()
    assert sorted(f.name for f in fields) == sorted(OLD_FIELDS + ADDED_FIELDS)
    for f in fields:
        assert 0 < len(f.help) <= 260 and f.help.count(". ") <= 2, f"{f.name}: help too long: {f.help}"
    by_name = {f.name: f for f in fields}
    assert by_name["l0_coeff"].kinds == ("jumprelu", "jumprelu-relative")
    assert by_name["l1_coeff"].kinds == ("relu", "crosscoder-l1")
    assert by_name["lr"].kinds is None and by_name["latents"].default is dataclasses.MISSING


def test_train_config_puts_kind_settings_in_place_and_to_flat_inverts_it():
    cfg = saes.train_config(latents=16, k=2, kind="jumprelu", l0_coeff=2.0, lr=1e-3)
    assert cfg.settings == JumpReLUSettings(l0_coeff=2.0) and cfg.lr == 1e-3
    flat = saes.to_flat(cfg)
    assert flat["l0_coeff"] == 2.0 and "matryoshka_groups" not in flat
    assert saes.train_config(**flat) == cfg
    assert sorted(saes.to_flat(cfg, every_kind=True)) == sorted(OLD_FIELDS + ADDED_FIELDS)
    assert saes.train_config(latents=16, k=2, kind="jumprelu").settings is None  # None: the kind's defaults
    assert saes.train_config(latents=16, k=2, kind="jumprelu").kind_settings == JumpReLUSettings()


def test_a_setting_of_another_kind_or_an_unknown_name_is_refused_clearly():
    with pytest.raises(ValueError, match="l0_coeff is a setting of jumprelu, jumprelu-relative; kind 'topk' does "
                                         "not read it: drop it or choose one of those kinds"):
        saes.train_config(latents=16, k=2, kind="topk", l0_coeff=2)
    with pytest.raises(ValueError, match="unknown training setting 'l0_coef': did you mean 'l0_coeff'"):
        saes.train_config(latents=16, k=2, l0_coef=2)
    with pytest.raises(ValueError, match="do not belong to kind 'topk'"):
        saes.TrainConfig(latents=16, k=2, settings=JumpReLUSettings())
    with pytest.raises(ValueError, match="jumprelu_bandwidth=0 must be positive"):
        saes.train_config(latents=16, k=2, kind="jumprelu-relative", jumprelu_bandwidth=0)


def test_sweeps_over_a_kind_setting_and_over_kinds():
    base = saes.train_config(latents=32, k=4, kind="jumprelu")
    points = sweep_configs(base, {"l0_coeff": [1.0, 2.0]})
    assert [(n, c.settings.l0_coeff) for n, c in points] == [("l0_coeff-1.0", 1.0), ("l0_coeff-2.0", 2.0)]
    base = saes.train_config(latents=32, k=4, kind="batchtopk", threshold_start_step=5)
    points = dict(sweep_configs(base, {"kind": ["batchtopk", "matryoshka", "topk"]}))
    assert points["kind-matryoshka"].settings == MatryoshkaSettings(threshold_start_step=5)
    assert points["kind-topk"].settings is None  # topk reads no threshold setting: the base's is left out
    with pytest.raises(ValueError, match="sweep point l0_coeff-2: l0_coeff is a setting of jumprelu"):
        sweep_configs(saes.train_config(latents=32, k=4), {"l0_coeff": [2]})


def test_the_registry_answers_what_kind_lists_used_to():
    several = sorted(k for k in saes.KINDS if saes.is_crosscoder(k))
    assert several == ["crosscoder", "crosscoder-absolute", "crosscoder-l1"]
    pairs = sorted(k for k in saes.KINDS if saes.reads_several_sources(k) and not saes.is_crosscoder(k))
    assert pairs == ["clt", "clt-batchtopk", "skip-transcoder", "transcoder"] and all(saes.kind_spec(k).transcodes for k in pairs)
    assert calibration_batch_count(saes.train_config(latents=8, k=2, kind="matryoshka")) == 2
    assert calibration_batch_count(saes.train_config(latents=8, k=2, kind="crosscoder-l1")) == 0
    assert flat_for_kind({"kind": "relu", "l1_coeff": 1.0, "l0_coeff": 2.0, "lr": 1.0}, "relu") == {
        "kind": "relu", "l1_coeff": 1.0, "lr": 1.0}


def test_a_checkpoint_that_recorded_another_kinds_setting_resumes(tmp_path):
    """Runs before the kinds owned their settings recorded every kind's (TrainConfig took them all): a topk
    checkpoint with l1_coeff 0.05 resumes, a changed setting of its own kind is still refused."""
    import functools

    import torch

    from crashing import Crash, crashing
    from generators.synthetic import SyntheticSpec, synthetic_batches

    spec = SyntheticSpec(n_atoms=24, d=8, active=2, batch_size=32, n_batches=12, seed=2)
    data = functools.partial(synthetic_batches, spec)
    cfg = saes.train_config(latents=16, k=2, kind="batchtopk", eval_batches=1, checkpoint_every=3, device="cpu",
                            init_rows=32, kernel_impl="reference", log_every=100, threshold_start_step=2)
    full = saes.train(cfg, data, out=tmp_path / "full")
    with pytest.raises(Crash):
        saes.train(cfg, crashing(data, at=8), out=tmp_path / "cut")
    path = tmp_path / "cut" / "checkpoint.pt"
    ck = torch.load(path, weights_only=True)
    assert ck["config"]["l1_coeff"] == 0.4 and ck["config"]["threshold_start_step"] == 2  # the complete record
    torch.save({**ck, "config": {**ck["config"], "l1_coeff": 0.05}}, path)
    other = dataclasses.replace(cfg, settings=dataclasses.replace(cfg.settings, threshold_start_step=3))
    with pytest.raises(ValueError, match="threshold_start_step"):
        saes.train(other, data, out=tmp_path / "cut", resume=True)
    resumed = saes.train(cfg, data, out=tmp_path / "cut", resume=True)
    assert torch.equal(resumed.W_dec, full.W_dec)
