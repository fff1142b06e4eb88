"""A tiny random CLIP and labelled images made in the test, all offline.

- :func:`build_tiny_clip` — a ``transformers`` CLIPModel (2-block vision and text towers, width 32, 32x32 images
  in 8x8 patches, projection 16) saved with its CLIPProcessor: an image processor and a byte-level BPE
  tokenizer whose vocabulary is the 256 byte characters (built here, nothing downloaded).
- :func:`make_shapes` — a folder tree ``ROOT/<colour>/<shape>-<i>.png`` of coloured shapes on a grey
  background (the class is the colour).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220)}
SHAPES = ("circle", "square", "triangle")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
        range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def build_tiny_clip(directory: Path, seed: int = 0) -> Path:
    import torch
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    chars = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    bos, eos = len(vocab), len(vocab) + 1
    vocab.update({"<|startoftext|>": bos, "<|endoftext|>": eos})
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"))
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=32, bos_token_id=bos, eos_token_id=eos,
                         pad_token_id=eos),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=16)
    torch.manual_seed(seed)
    model = CLIPModel(config).eval()
    processor = CLIPProcessor(image_processor=CLIPImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}), tokenizer=tokenizer)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def draw(shape: str, colour: tuple[int, int, int], size: int = 48, jitter: int = 0):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (128, 128, 128))
    pen = ImageDraw.Draw(image)
    a, b = 8 + jitter, size - 8 + jitter
    if shape == "circle":
        pen.ellipse([a, a, b, b], fill=colour)
    elif shape == "square":
        pen.rectangle([a, a, b, b], fill=colour)
    else:
        pen.polygon([(size // 2 + jitter, a), (a, b), (b, b)], fill=colour)
    return image


def make_shapes(root: Path, per_class: int = 6, seed: int = 0) -> Path:
    """``root/<colour>/<shape>-<i>.png``: ``per_class`` images per colour, shapes cycling, positions jittered."""
    rng = random.Random(seed)
    for colour, rgb in COLOURS.items():
        (root / colour).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            shape = SHAPES[i % len(SHAPES)]
            draw(shape, rgb, jitter=rng.randint(-4, 4)).save(root / colour / f"{shape}-{i}.png")
    return root


def build_tiny_image_model(directory: Path, kind: str, seed: int = 0) -> Path:
    """A random-init ``vit``, ``dinov2``, ``dinov2_with_registers`` (2 registers) or ``siglip`` model (1 block,
    width 32, 32x32 images in 8x8 patches) saved with its image processor; SigLIP borrows the tiny CLIP's
    byte-level tokenizer (its own is a SentencePiece model that cannot be built offline)."""
    import torch
    import transformers as tf
    from transformers.models.bit.image_processing_pil_bit import BitImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    directory = Path(directory)
    tower = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8)
    square = {"height": 32, "width": 32}
    torch.manual_seed(seed)
    if kind == "vit":
        model = tf.ViTModel(tf.ViTConfig(intermediate_size=64, **tower))
        processor = ViTImageProcessorPil(size=square)
    elif kind in ("dinov2", "dinov2_with_registers"):
        config = (tf.Dinov2Config(mlp_ratio=2, **tower) if kind == "dinov2" else
                  tf.Dinov2WithRegistersConfig(mlp_ratio=2, num_register_tokens=2, **tower))
        model = tf.AutoModel.from_config(config)
        processor = BitImageProcessorPil(size={"shortest_edge": 32}, crop_size=square)
    elif kind == "siglip":
        build_tiny_clip(directory / "clip-tokenizer", seed)
        tokenizer = tf.AutoTokenizer.from_pretrained(directory / "clip-tokenizer")
        config = tf.SiglipConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, max_position_embeddings=16, pad_token_id=tokenizer.pad_token_id),
            vision_config=dict(intermediate_size=64, **tower))
        model = tf.SiglipModel(config)
        processor = SiglipImageProcessorPil(size=square)
        tokenizer.save_pretrained(directory)
    else:
        raise ValueError(kind)
    model.eval().save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
