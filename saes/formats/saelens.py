"""SAELens directories: ``cfg.json`` + ``sae_weights.safetensors`` (read and written).

Read: architectures standard (ReLU), topk (also with ``rescale_acts_by_decoder_norm``, folded), jumprelu and
gated, SAELens 6 configs (``metadata``
block) and older ones (top-level ``hook_name``, ``activation_fn_str``). ``apply_b_dec_to_input: false`` is
folded into ``b_enc`` (``x W + e = (x - b) W + (e + b W)``). ``normalize_activations``:
``none`` is read as is; ``expected_average_only_in`` and ``covariance_whitening`` are folded into the weights
(as sae-lens's own ``fold_*`` methods do) with the constants where sae-lens keeps them next to the weights
(``activation_scaler.json``, ``activation_whitening.safetensors``; or ``norm_scaling_factor`` in cfg.json), and
refused when those files are absent; the per-input normalisers (``constant_norm_rescale``, ``layer_norm``)
make the dictionary non-affine and are refused. Everything is converted to float32.

Written (checked against sae-lens 6.54): each kind as the architecture its ``KindSpec.saelens`` declares
(saes/kinds/): TopK -> ``topk`` with ``k``; batchtopk-absolute -> ``jumprelu`` with its inference threshold (and
``conceptdict_k`` in the metadata; the row-relative ``batchtopk`` is refused); ReLU -> ``standard``; jumprelu and
gated as themselves. ``metadata.sae_lens_version`` is written so that sae-lens >= 6 keeps our metadata.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..kinds import KINDS
from ..model import SparseCoder
from .common import Loaded, build, foreign_config
from .files import FormatError, expect_shapes, read_json, read_safetensors
from .hookpoints import from_transformer_lens, to_transformer_lens

CONFIG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
SCALER = "activation_scaler.json"
WHITENING = "activation_whitening.safetensors"
NEEDS = f"{CONFIG} with 'd_sae' + {WEIGHTS}"
SAELENS_VERSION = "6.54.12"
"""Written as ``metadata.sae_lens_version``: the sae-lens release tests/foreign checks the export against."""

ARCH_TO_KIND = {"standard": "relu", "topk": "topk", "jumprelu": "jumprelu", "gated": "gated"}
"""SAELens architecture -> the kind it is read as (every architecture this module reads and writes)."""


def architecture_of(kind: str) -> str | None:
    """The SAELens architecture a dictionary of ``kind`` is written as (its ``KindSpec.saelens``; the classical
    BatchTopK is saved as the JumpReLU it runs as at inference); None for a kind without one, or not registered."""
    spec = KINDS.get(kind)
    return spec.saelens if spec is not None else None


class _KindToArch(Mapping):
    """our kind -> SAELens architecture, read from the kind registry on every access (a kind added with
    ``saes.kinds.register`` is in it)."""

    def __getitem__(self, kind: str) -> str:
        arch = architecture_of(kind)
        if arch is None:
            raise KeyError(kind)
        return arch

    def __iter__(self) -> Iterator[str]:
        return (name for name, spec in KINDS.items() if spec.saelens is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


KIND_TO_ARCH: Mapping[str, str] = _KindToArch()
"""our kind -> SAELens architecture, for every kind that declares one (``KindSpec.saelens``)."""


def exports_exactly(kind: str) -> bool:
    """Whether a dictionary of ``kind`` exports to SAELens with the same codes and reconstructions."""
    return architecture_of(kind) is not None


def _why_not(kind: str) -> str:
    """Why ``kind`` has no SAELens equivalent, where the registry says (a row-relative rule), for messages."""
    spec = KINDS.get(kind)
    return " (row-relative: its bias and threshold scale with each row's norm)" if spec and spec.relative else ""


EXTRA_TENSORS = {"jumprelu": ("threshold",), "gated": ("r_mag", "b_mag")}


def matches(directory: Path) -> bool:
    if not (directory / CONFIG).exists() or not (directory / WEIGHTS).exists():
        return False
    return "d_sae" in read_json(directory / CONFIG)


def _architecture(cfg: dict[str, Any], path: Path) -> tuple[str, int | None]:
    """(SAELens architecture, k) for 6.x and pre-6 configs."""
    arch = cfg.get("architecture", "standard")
    fn = cfg.get("activation_fn") or cfg.get("activation_fn_str")
    if arch == "standard" and fn == "topk":  # pre-6: a TopK SAE was 'standard' with activation_fn topk
        arch = "topk"
        return arch, int((cfg.get("activation_fn_kwargs") or {}).get("k") or cfg.get("k"))
    if arch not in ARCH_TO_KIND:
        raise FormatError(f"{path}: SAELens architecture {arch!r} is not supported; supported: "
                          f"{sorted(ARCH_TO_KIND)}")
    if arch == "topk":
        if cfg.get("k") is None:
            raise FormatError(f"{path}: architecture {arch!r} needs 'k' in the config")
        return arch, int(cfg["k"])
    return arch, None


def _fold_normalisation(cfg: dict[str, Any], t: dict[str, torch.Tensor], directory: Path) -> str | None:
    """Fold ``normalize_activations`` into the weights ``t`` (SAELens layout, in place) exactly as sae-lens's
    ``fold_activation_norm_scaling_factor`` / ``fold_activation_whitening`` do; returns what was folded."""
    mode, path = cfg.get("normalize_activations") or "none", directory / CONFIG
    scaler = directory / SCALER
    stored = read_json(scaler) if scaler.exists() else {}
    if mode == "none":
        return None
    if mode == "expected_average_only_in":
        factor = stored.get("scaling_factor", cfg.get("norm_scaling_factor"))
        if factor is None:
            raise FormatError(f"{path}: normalize_activations='expected_average_only_in' but the directory stores no "
                              f"scaling factor ({SCALER} 'scaling_factor' or cfg.json 'norm_scaling_factor', where "
                              f"sae-lens keeps it); fold it with sae.fold_activation_norm_scaling_factor and save "
                              f"again")
        t["W_enc"], t["W_dec"], t["b_dec"] = t["W_enc"] * factor, t["W_dec"] / factor, t["b_dec"] / factor
        return f"scaling factor {factor} from {SCALER if 'scaling_factor' in stored else CONFIG}"
    if mode == "covariance_whitening":
        wpath = directory / WHITENING
        if not wpath.exists() or not cfg.get("apply_b_dec_to_input", True):
            raise FormatError(f"{path}: normalize_activations='covariance_whitening' needs {wpath.name} next to it "
                              f"(and apply_b_dec_to_input true); fold it with sae.fold_activation_whitening first")
        w = {k: v.double() for k, v in read_safetensors(wpath).items()}
        M, Minv, mean = w["matrix"], w["inverse_matrix"], w["mean"]
        t["W_enc"] = (M @ t["W_enc"].double()).float()
        t["W_dec"] = (t["W_dec"].double() @ Minv).float()
        t["b_dec"] = (t["b_dec"].double() @ Minv + mean).float()
        return f"covariance whitening from {WHITENING}"
    raise FormatError(f"{path}: normalize_activations={mode!r} rescales every input by its own statistics, so the "
                      f"dictionary is not an affine map conceptdict can hold; importable: none, "
                      f"expected_average_only_in and covariance_whitening (with their stored constants)")


def read(directory: Path) -> Loaded:
    path, wpath = directory / CONFIG, directory / WEIGHTS
    cfg = read_json(path)
    arch, k = _architecture(cfg, path)
    meta = cfg.get("metadata") or {}
    if meta.get("hook_head_index", cfg.get("hook_head_index")) is not None:
        raise FormatError(f"{path}: hook_head_index is set (an SAE on one attention head's slice); conceptdict "
                          f"stores whole hookpoints, so the slice cannot be matched")
    D, L = int(cfg["d_in"]), int(cfg["d_sae"])
    t = read_safetensors(wpath)
    gated = arch == "gated"
    shapes = {"W_enc": (D, L), "b_gate" if gated else "b_enc": (L,), "W_dec": (L, D), "b_dec": (D,)}
    shapes.update({n: (L,) for n in EXTRA_TENSORS.get(arch, ())})
    expect_shapes(wpath, t, shapes, path)
    tensors = {n: t[n].float() for n in ("W_enc", "W_dec", "b_dec", *EXTRA_TENSORS.get(arch, ()))}
    tensors["b_enc"] = t["b_gate" if gated else "b_enc"].float()
    if arch == "topk" and cfg.get("rescale_acts_by_decoder_norm"):  # codes f * |d_j|, decoded as f / |d_j|
        n = tensors["W_dec"].norm(dim=1)
        tensors.update(W_enc=tensors["W_enc"] * n, b_enc=tensors["b_enc"] * n, W_dec=tensors["W_dec"] / n[:, None])
    folded = _fold_normalisation(cfg, tensors, directory)
    if not cfg.get("apply_b_dec_to_input", True):  # x W + e = (x - b_dec) W + (e + b_dec W), on both gated paths
        shift = tensors["b_dec"] @ tensors["W_enc"]
        tensors["b_enc"] = tensors["b_enc"] + shift
        if gated:
            tensors["b_mag"] = tensors["b_mag"] + shift * torch.exp(tensors["r_mag"])
    kind = ARCH_TO_KIND[arch]
    ours = meta.get("conceptdict_kind")
    ours = "batchtopk-absolute" if ours == "batchtopk" else ours  # exports before the row-relative rule
    if meta.get("conceptdict_k") and (ours == kind or (arch == "jumprelu" and ours == "batchtopk-absolute")):
        kind, k = ours, int(meta["conceptdict_k"])  # our own export: the same kind and k come back
    model = build(kind, D, L, k, tensors)
    hook = meta.get("hook_name") or cfg.get("hook_name")
    extra = {"saelens": {"architecture": arch, "dtype": cfg.get("dtype"),
                         "normalize_activations": cfg.get("normalize_activations", "none"),
                         "apply_b_dec_to_input": cfg.get("apply_b_dec_to_input", True),
                         "normalisation_folded": folded}}
    name = meta.get("model_name") or cfg.get("model_name")
    mapped = meta.get("conceptdict_hookpoint") or (from_transformer_lens(hook) if hook else None)
    return Loaded(model, foreign_config("saelens", directory, model, hookpoint=hook, mapped=mapped,
                                        model_name=name if isinstance(name, str) else None, extra=extra))


def write(model: SparseCoder, directory: Path, meta: dict[str, Any] | None = None) -> Path:
    """Write ``cfg.json`` + ``sae_weights.safetensors`` that ``sae_lens.SAE.load_from_disk`` reads.

    ``meta`` fills SAELens ``metadata`` (model_name, hook_name, context_size, prepend_bos, dataset_path, ...)."""
    from ..artifact import write_json
    from ..lazy import save_tensors_of

    if model.n_sources != 1:
        raise ValueError(f"SAELens has no crosscoder layout (n_sources={model.n_sources}); export the native "
                         f"artifact with save_dictionary instead")
    arch = architecture_of(model.kind)
    if arch is None:
        raise ValueError(f"kind {model.kind!r}{_why_not(model.kind)} has no SAELens equivalent; to share a "
                         f"dictionary through SAELens, Neuronpedia or SAEBench train it with --kind topk (train's "
                         f"default), --kind batchtopk-absolute (the classical BatchTopK, which SAELens reads as "
                         f"JumpReLU) or another of {sorted(KIND_TO_ARCH)}")
    if arch not in ARCH_TO_KIND:
        raise ValueError(f"kind {model.kind!r} declares SAELens architecture {arch!r} (KindSpec.saelens), which this "
                         f"writer does not write; declare one of {sorted(ARCH_TO_KIND)} or None")
    directory.mkdir(parents=True, exist_ok=True)
    metadata = {"sae_lens_version": SAELENS_VERSION, "sae_lens_training_version": None, "model_name": None,
                "hook_name": None, "hook_head_index": None, "context_size": None, "prepend_bos": True,
                "dataset_path": None, "exported_by": "conceptdict", "conceptdict_kind": model.kind,
                "conceptdict_k": model.k}
    metadata.update(meta or {})
    if metadata["model_name"] is not None and not isinstance(metadata["model_name"], str):
        raise ValueError(f"SAELens model_name must be the model's name string, got {metadata['model_name']!r}")
    cfg: dict[str, Any] = {"architecture": arch, "d_in": model.d_in, "d_sae": model.n_latents, "dtype": "float32",
                           "device": "cpu", "apply_b_dec_to_input": True, "normalize_activations": "none",
                           "reshape_activations": "none", "metadata": metadata}
    if arch == "topk":
        cfg.update(k=model.k, rescale_acts_by_decoder_norm=False)
    def tensors(block: SparseCoder) -> dict[str, torch.Tensor]:
        out = {"W_enc": block.W_enc, "W_dec": block.W_dec, "b_dec": block.b_dec,
               "b_gate" if arch == "gated" else "b_enc": block.b_enc}
        out.update({n: getattr(block, n) for n in EXTRA_TENSORS.get(arch, ())})
        return {k: v.float() for k, v in out.items()}

    save_tensors_of(model, directory / WEIGHTS, tensors, {})  # a lazy dictionary: block by block
    write_json(directory / CONFIG, cfg)
    return directory



def export(model: SparseCoder, out: Path, *, config: dict[str, Any], model_name: str | None,
           hookpoint: str | None) -> Path:
    """``conceptdict export --format saelens`` (``saes.formats.export.WRITERS``): :func:`write` with the model's name
    and the hookpoint in the metadata (TransformerLens's ``hook_name``, ours as ``conceptdict_hookpoint``)."""
    return write(model, out, {"model_name": model_name, "conceptdict_hookpoint": hookpoint,
                              "hook_name": to_transformer_lens(hookpoint) if hookpoint else None})
