"""Image models through ``transformers``: CLIP / SigLIP (image + text towers), ViT / DINOv2 (image encoders).

Loaded with ``AutoModel.from_pretrained`` from a hub name or a local directory, with the model's own image
processor (resizing, cropping, normalising) and, for CLIP-like models, its tokenizer. Weights are used as
Hugging Face stores them. Hookpoints, named like the text ones:

- ``image.embed``: the projected pooled image embedding, exactly ``get_image_features`` for CLIP / SigLIP
  (what Discover-then-Name trains on); for an image encoder without a projection, its pooled output
  (ViT: the pooler, DINOv2: the normalised CLS token). ``image.embed_normalized``: the same, L2-normalised.
- ``vision.blocks.{i}.hook_out``: the output of block i of the vision tower, one row per token: the CLS
  token (stored at position -1) and the patch tokens (position = patch index, row-major over the grid).
  Register tokens (DINOv2 with registers) are not stored.
- ``text.embed`` / ``text.embed_normalized`` (CLIP-like models only): ``get_text_features`` of a text, the
  space the vocabulary namer compares ``image.embed`` directions with; not cacheable over images.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# model_type -> (has a text tower, prefix tokens before the patches besides registers)
VISION_TYPES = {"clip": (True, 1), "siglip": (True, 0), "vit": (False, 1), "dinov2": (False, 1),
                "dinov2_with_registers": (False, 1)}
POOLED_HOOKPOINTS = ("image.embed", "image.embed_normalized")
TEXT_HOOKPOINTS = ("text.embed", "text.embed_normalized")
CLS_POSITION = -1
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def model_type_of(name_or_dir: str) -> str | None:
    """The Hugging Face ``model_type`` of a local directory (its config.json) or a hub name (through
    ``AutoConfig``, from the local cache when offline); None when it cannot be read."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        config = path / "config.json"
        try:
            return json.loads(config.read_text()).get("model_type") if config.exists() else None
        except (OSError, json.JSONDecodeError):
            return None
    if name_or_dir == "default" or not name_or_dir:
        return None
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name_or_dir).model_type
    except Exception:  # noqa: BLE001 - not an image model we can tell; the text loader reports the real error
        return None


def is_vision_model(name_or_dir: str | None) -> bool:
    """True when ``name_or_dir`` is a model this module loads (CLIP, SigLIP, ViT, DINOv2)."""
    return bool(name_or_dir) and model_type_of(str(name_or_dir)) in VISION_TYPES


@dataclass(repr=False)
class ImageModelHandle:
    """A loaded image model (the image family's :class:`~conceptdict.activations.families.Model`). ``hookpoints``
    lists every valid name (``text.*`` only for CLIP-like models). For a user's code: ``run_with_cache(images)``,
    ``embed_images``, ``embed_texts`` (CLIP-like models) and ``model(images)`` (the ``image.embed`` embeddings)."""

    name: str
    model: Any
    processor: Any
    tokenizer: Any
    device: str
    dtype: str
    load_info: dict
    hookpoints: list[str]
    has_text: bool
    prefix_tokens: int
    registers: int
    _dims: dict[str, int] = field(default_factory=dict, repr=False)
    family = "image"

    def __repr__(self) -> str:
        from conceptdict.activations.models import handle_repr

        return handle_repr(self)

    def level(self, hookpoint: str) -> str:
        """``"sequence"`` for the pooled (and text) embeddings, one row per input; ``"token"`` for the blocks."""
        return "sequence" if hookpoint in FAMILY.pooled_hookpoints else "token"

    def hookpoint_rows(self) -> list:
        """Every hookpoint with its shape, from one probe image (``activations.listing.image_rows``)."""
        from conceptdict.activations.listing import image_rows

        return image_rows(self)

    def run_with_cache(self, images, names: str | Sequence[str] | None = None):
        """``Cached(image.embed [batch, D], cache)`` of one forward of the vision tower over images (PIL images or
        paths, one or a list) or pixel values [batch, 3, H, W]: ``cache[hp]`` is [batch, D] at a pooled hookpoint,
        [batch, tokens, D] at a block (every token as the tower orders them: CLS, registers, patches). ``names``:
        the hookpoints to keep; None: every image hookpoint. No gradients."""
        names = ([h for h in self.hookpoints if h not in TEXT_HOOKPOINTS] if names is None else
                 [names] if isinstance(names, str) else list(names))
        from conceptdict.activations.wrapper import Cached

        got = capture_images(self, pixel_values(self, images), list(dict.fromkeys([*names, POOLED_HOOKPOINTS[0]])))
        return Cached(got[POOLED_HOOKPOINTS[0]], {h: got[h] for h in names})

    def to_tokens(self, texts: str | Sequence[str], return_mask: bool = False,
                  max_length: int | None = None) -> torch.Tensor:
        """An image model's forward reads images, not tokens: ValueError naming what to use."""
        raise ValueError(f"{self.name} is an image model: its forward reads images (model.run_with_cache(images)); "
                         f"texts go through model.embed_texts(texts) where it has a text tower")

    def to_string(self, ids) -> str | list[str]:
        """The text of its text tower's token ids (CLIP-like models); ValueError for a model without one."""
        if self.tokenizer is None:
            raise ValueError(f"{self.name} is an image model without a text tower: it has no token ids to decode")
        t = torch.as_tensor(ids)
        return [self.tokenizer.decode(row.tolist()) for row in t] if t.dim() == 2 else self.tokenizer.decode(t.tolist())

    def run_with_saes(self, inputs, saes, return_codes: bool = False) -> torch.Tensor:
        """Not for image models: ValueError naming what to do instead."""
        raise ValueError(f"{self.name} is an image model: a dictionary is not spliced into its forward; encode its "
                         f"rows instead: sae.encode(model.run_with_cache(images).cache[hookpoint]) or "
                         f"sae.encode(model.embed_images(images, hookpoint))")

    def __call__(self, images) -> torch.Tensor:
        """The ``image.embed`` embeddings [batch, D] of images or pixel values."""
        return self.run_with_cache(images, names=[])[0]

    def embed_images(self, images, hookpoint: str | None = None, batch_size: int = 64) -> torch.Tensor:
        """[N, D] float32, one row per image at ``hookpoint`` (default ``image.embed``; a block: the mean over the
        rows a store holds of the image, CLS and patches), to encode new images with an image dictionary."""
        hookpoint = hookpoint or POOLED_HOOKPOINTS[0]
        check_image_hookpoints(self, [hookpoint])
        images = [images] if not isinstance(images, (list, tuple)) else list(images)
        out = []
        for i in range(0, len(images), batch_size):
            acts = capture_images(self, pixel_values(self, images[i:i + batch_size]), [hookpoint])[hookpoint]
            if acts.dim() == 3:
                acts = patch_rows(self, acts)[0].reshape(acts.shape[0], -1, acts.shape[-1]).mean(1)
            out.append(acts.float().cpu())
        return torch.cat(out) if out else torch.zeros(0, self.d_model(hookpoint))

    def embed_texts(self, texts: Sequence[str], hookpoint: str | None = None, batch_size: int = 64) -> torch.Tensor:
        """[N, D] float32 ``get_text_features`` of each text (CLIP-like models; :func:`embed_texts`)."""
        return embed_texts(self, list(texts), hookpoint or TEXT_HOOKPOINTS[0], batch_size)

    @property
    def tower(self):
        """The vision tower (``vision_model`` of CLIP / SigLIP, the model itself for ViT / DINOv2)."""
        return getattr(self.model, "vision_model", self.model)

    def d_model(self, hookpoint: str) -> int:
        """D of ``hookpoint`` (a probe forward on one blank image the first time)."""
        check_image_hookpoints(self, [hookpoint], cacheable=False)
        if hookpoint not in self._dims:
            if hookpoint in TEXT_HOOKPOINTS:
                self._dims[hookpoint] = int(embed_texts(self, ["a"], hookpoint).shape[-1])
            else:
                from PIL import Image

                pixels = preprocess(self, [Image.new("RGB", (32, 32))])
                self._dims[hookpoint] = int(capture_images(self, pixels, [hookpoint])[hookpoint].shape[-1])
        return self._dims[hookpoint]

    def special_ids(self) -> list[int]:
        return []

    def decode(self, ids: Sequence[int]) -> list[str]:
        return [f"<{int(i)}>" for i in ids]

    def unembed(self) -> None:
        return None


def load_image_model(name_or_dir: str, device: str = "cpu", dtype: str = "float32") -> ImageModelHandle:
    """Load a CLIP / SigLIP / ViT / DINOv2 model, its image processor and (CLIP-like) tokenizer (through
    ``families.load_model``, which checks the device and dtype first)."""
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    local = Path(name_or_dir).expanduser()
    source = str(local.resolve()) if local.is_dir() else str(name_or_dir)
    try:
        model = AutoModel.from_pretrained(source, dtype=DTYPES[dtype]).to(device).eval()
        processor = AutoImageProcessor.from_pretrained(source)
    except OSError as e:
        raise ValueError(f"cannot load image model {name_or_dir!r}: {str(e).splitlines()[0]}. Pass a directory "
                         "saved with save_pretrained (model and image processor) or a hub name reachable from "
                         "this machine") from None
    model_type = model.config.model_type
    has_text, prefix = VISION_TYPES[model_type]
    try:
        tokenizer = AutoTokenizer.from_pretrained(source) if has_text else None
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"image model {name_or_dir!r} ({model_type}) has a text tower but no tokenizer could be "
                         f"loaded ({str(e).splitlines()[0]}); save its processor (image processor and tokenizer) "
                         "with save_pretrained into the same directory") from None
    vcfg = getattr(model.config, "vision_config", model.config)
    registers = int(getattr(vcfg, "num_register_tokens", 0) or 0)
    n_blocks = int(vcfg.num_hidden_layers)
    hookpoints = list(POOLED_HOOKPOINTS) + [f"vision.blocks.{i}.hook_out" for i in range(n_blocks)]
    hookpoints += list(TEXT_HOOKPOINTS) if has_text else []
    info = {"id": str(name_or_dir), "source": source, "kind": "local directory" if local.is_dir() else "hub name",
            "loader": f"transformers.AutoModel ({type(model).__name__})", "modality": "image",
            "weight_processing": "none (raw Hugging Face weights)", "dtype": dtype, "device": device,
            "model_type": model_type, "architectures": list(getattr(model.config, "architectures", None) or []),
            "n_layers": n_blocks, "d_model": int(vcfg.hidden_size), "has_text_tower": has_text}
    log.info("loaded image model %s (%s, %s on %s)", name_or_dir, model_type, dtype, device)
    return ImageModelHandle(str(name_or_dir), model, processor, tokenizer, device, dtype, info, hookpoints,
                            has_text, prefix, registers)


def check_image_hookpoints(handle: ImageModelHandle, hookpoints: Sequence[str], cacheable: bool = True) -> None:
    """Raise ValueError for an unknown hookpoint (listing the closest valid names), for text hookpoints when
    caching over images, and for a mix of pooled and per-token hookpoints."""
    from conceptdict.activations.models import unknown_hookpoint

    for hp in hookpoints:
        if hp not in handle.hookpoints:
            raise ValueError(unknown_hookpoint(hp, handle.hookpoints, handle.name))
        if cacheable and hp in TEXT_HOOKPOINTS:
            raise ValueError(f"hookpoint {hp!r} embeds texts (the vocabulary namer uses it); cache image "
                             f"hookpoints over images: {', '.join(POOLED_HOOKPOINTS)} or vision.blocks.N.hook_out")


def preprocess(handle: ImageModelHandle, images: list) -> torch.Tensor:
    """PIL images -> pixel_values [b, 3, H, W] through the model's own image processor."""
    return handle.processor(images=images, return_tensors="pt")["pixel_values"]


def pixel_values(handle: ImageModelHandle, images) -> torch.Tensor:
    """pixel_values [b, 3, H, W] of a PIL image, an image file's path, a list of them, or pixel values already
    ([3, H, W] or [b, 3, H, W])."""
    from PIL import Image

    if torch.is_tensor(images):
        if images.dim() not in (3, 4) or not images.is_floating_point():
            raise ValueError(f"pixel values must be float [batch, 3, H, W] or [3, H, W], got {images.dtype} "
                             f"{list(images.shape)}")
        return images[None] if images.dim() == 3 else images
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise ValueError("no images given")
    opened = []
    for item in items:
        if isinstance(item, (str, Path)):
            with Image.open(Path(item).expanduser()) as image:
                opened.append(image.convert("RGB"))
        elif isinstance(item, Image.Image):
            opened.append(item.convert("RGB"))
        else:
            raise TypeError(f"an image is a PIL image or a file path, got {type(item).__name__}")
    return preprocess(handle, opened)


def _pooled(handle: ImageModelHandle, out) -> torch.Tensor:
    """The projected pooled embedding from the vision tower's output (``get_image_features``'s numbers)."""
    projection = getattr(handle.model, "visual_projection", None)
    pooled = out.pooler_output if getattr(out, "pooler_output", None) is not None else out.last_hidden_state[:, 0]
    return projection(pooled) if projection is not None else pooled


def capture_images(handle: ImageModelHandle, pixel_values: torch.Tensor,
                   hookpoints: Sequence[str]) -> dict[str, torch.Tensor]:
    """One forward of the vision tower: pooled hookpoints [b, D], block hookpoints [b, T, D] (every token, the
    CLS / register prefix first, as the tower orders them)."""
    check_image_hookpoints(handle, hookpoints)
    dtype = DTYPES[handle.dtype]
    with torch.no_grad():
        out = handle.tower(pixel_values=pixel_values.to(handle.device, dtype), output_hidden_states=True)
        result = {}
        for hp in hookpoints:
            if hp in POOLED_HOOKPOINTS:
                emb = _pooled(handle, out).float()
                result[hp] = torch.nn.functional.normalize(emb, dim=-1) if hp.endswith("normalized") else emb
            else:
                result[hp] = out.hidden_states[int(hp.split(".")[2]) + 1]
    return result


def patch_rows(handle: ImageModelHandle, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, T, D] block output -> (rows [b * (1 + P), D] or [b * P, D] without a CLS token, positions): per
    image the CLS row (position -1) then its P patch rows (positions 0..P-1); register tokens dropped."""
    b, T, D = tokens.shape
    cls = handle.prefix_tokens
    patches = tokens[:, cls + handle.registers:]
    P = patches.shape[1]
    parts = ([tokens[:, :1]] if cls else []) + [patches]
    pos = torch.cat([torch.full((cls,), CLS_POSITION, dtype=torch.int32), torch.arange(P, dtype=torch.int32)])
    return torch.cat(parts, dim=1).reshape(-1, D), pos.repeat(b)


def patch_grid(n_patches: int) -> list[int]:
    """[rows, cols] of a square patch grid (processors resize to squares)."""
    side = math.isqrt(n_patches)
    return [side, side] if side * side == n_patches else [1, n_patches]


def embed_texts(handle: ImageModelHandle, texts: list[str], hookpoint: str = "text.embed",
                batch_size: int = 64) -> torch.Tensor:
    """[N, D] float32 ``get_text_features`` of each text (``text.embed_normalized``: L2-normalised; any other
    hookpoint, e.g. the image hookpoint a caller names, gives ``text.embed``: the text side of the joint space)."""
    if not handle.has_text:
        raise ValueError(f"model {handle.name} ({handle.load_info['model_type']}) has no text tower")
    if hookpoint not in TEXT_HOOKPOINTS:
        hookpoint = "text.embed"
    padding = "max_length" if handle.load_info["model_type"] == "siglip" else True  # SigLIP trained on padded text
    limit = int(getattr(handle.model.config.text_config, "max_position_embeddings", 77))
    out = []
    with torch.inference_mode():
        for i in range(0, len(texts), batch_size):
            enc = handle.tokenizer(texts[i:i + batch_size], padding=padding, truncation=True, max_length=limit,
                                   return_tensors="pt").to(handle.device)
            feats = handle.model.get_text_features(**enc)
            feats = feats if torch.is_tensor(feats) else feats.pooler_output
            out.append(feats.float().cpu())
    emb = torch.cat(out) if out else torch.zeros(0, 1)
    return torch.nn.functional.normalize(emb, dim=-1) if hookpoint.endswith("normalized") else emb


def directions_to_text_space(handle: ImageModelHandle, hookpoint: str, directions: torch.Tensor) -> torch.Tensor:
    """Decoder directions [L, D] of ``hookpoint`` as directions of the text tower's space: ``image.embed*``
    directions are already there (Discover-then-Name, exact); CLIP block directions go through the final
    layer norm's affine part (centred, scaled by its weight) and the visual projection, a linear read-out like
    the logit lens (approximate: the per-row normalisation is left out)."""
    if hookpoint in POOLED_HOOKPOINTS:
        return directions
    projection = getattr(handle.model, "visual_projection", None)
    norm = getattr(handle.tower, "post_layernorm", None)
    if projection is None or norm is None:
        raise ValueError(f"{handle.name} has no linear map from {hookpoint} to its text space; name the "
                         f"{POOLED_HOOKPOINTS[0]} dictionary, or use --namer context")
    d = directions.float() - directions.float().mean(-1, keepdim=True)
    with torch.no_grad():
        return (d * norm.weight.detach().float().cpu()) @ projection.weight.detach().float().cpu().T


class ImageFamily:
    """Image models through ``transformers``: CLIP, SigLIP (image and text towers), ViT, DINOv2."""

    name = "image"
    modality = "image"
    pooled_hookpoints = POOLED_HOOKPOINTS + TEXT_HOOKPOINTS

    def recognises(self, name_or_dir: str) -> bool:
        return is_vision_model(name_or_dir)

    def load(self, name_or_dir: str, device: str, dtype: str, tokenizer: str | None = None) -> ImageModelHandle:
        if tokenizer is not None:
            raise ValueError(f"{name_or_dir} is an image model: tokenizer={tokenizer!r} applies to text models only; "
                             "drop it (a CLIP-like model's text tower uses its own tokenizer)")
        return load_image_model(name_or_dir, device=device, dtype=dtype)

    def cache(self, cfg, records, part: tuple[int, int]) -> Path:
        from conceptdict.activations.image_cache import cache_images

        return cache_images(cfg, records, part)


FAMILY = ImageFamily()
