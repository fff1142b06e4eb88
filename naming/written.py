"""A concept dictionary written a block of latents at a time (``conceptdict name``; ``cd.name(in_memory=False)``).

:class:`ConceptsWriter` writes ``concepts.json`` and ``concepts.safetensors`` (the files :func:`save_concepts`
writes, byte for byte for the JSON) from blocks of concepts given in latent order; :class:`NamedWriter` adds the
HTML report (``naming.reports.report_stream.ReportWriter``: each block's cards go to a spool file as they come, and
the pages are put together at the end in the report's order from the spool, the score pages of a scored dictionary
from a second spool of each concept's row). What stays in memory across blocks: each latent's frequency (8 bytes),
where its card and its row lie in the spools (32 bytes) and the few most frequent concepts for the summary.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch
from torch import Tensor

from .concepts import FORMAT_VERSION, JSON_NAME, TENSORS_NAME, Concept, concept_to_json

SUMMARY = 12
"""Most frequent concepts a :class:`NamedSummary` keeps (the ones ``conceptdict name`` prints)."""


class ConceptsWriter:
    """``concepts.json`` and ``concepts.safetensors`` of ``n_concepts`` concepts with directions of
    ``directions_shape``: :meth:`add` a block (in latent order), :meth:`finish` with the meta. Until then both are
    ``.tmp`` files (the JSON's concepts in ``concepts.json.part``); a context manager removes them on an error."""

    def __init__(self, directory: str | Path, n_concepts: int, directions_shape: Sequence[int]) -> None:
        from conceptdict.saes.lazy_io import TensorsWriter

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.n, self.shape, self.done = n_concepts, tuple(directions_shape), 0
        self.tensors = TensorsWriter(self.directory / TENSORS_NAME, {
            "directions": (torch.float32, self.shape), "frequency": (torch.float32, (n_concepts,))},
            {"format_version": str(FORMAT_VERSION)})
        self.part_path = self.directory / (JSON_NAME + ".part")
        self.part = open(self.part_path, "w", encoding="utf-8")  # noqa: SIM115 (closed by finish / close)

    def add(self, concepts: Sequence[Concept], directions: Tensor) -> None:
        """The next block: its concepts (ids ``done, done + 1, ...``) and their directions [l, ...]."""
        first = self.done
        if [c.id for c in concepts] != list(range(first, first + len(concepts))):
            raise ValueError(f"concepts must come in latent order: expected ids from {first}, got "
                             f"{[c.id for c in concepts][:3]}...")
        if directions.shape[0] != len(concepts) or tuple(directions.shape[1:]) != self.shape[1:]:
            raise ValueError(f"{len(concepts)} concepts with directions {list(directions.shape)}; each needs one "
                             f"row of shape {list(self.shape[1:])}")
        self.tensors.write("directions", directions.float(), 0, first)
        self.tensors.write("frequency", torch.tensor([c.frequency for c in concepts], dtype=torch.float32), 0, first)
        for c in concepts:  # as json.dumps(doc, indent=1) nests each concept: two levels in
            if self.done:
                self.part.write(",\n")
            text = json.dumps(concept_to_json(c), indent=1, ensure_ascii=False)
            self.part.write("\n".join("  " + line for line in text.split("\n")))
            self.done += 1

    def finish(self, meta: dict[str, Any]) -> Path:
        """Write concepts.json (its head, the concepts, its tail) and close concepts.safetensors; returns the
        directory."""
        if self.done != self.n:
            raise ValueError(f"{self.done} concepts were written of the {self.n} declared; add every block")
        self.part.close()
        self.tensors.close()
        doc = {"format_version": FORMAT_VERSION, "n_concepts": self.n, "directions_shape": list(self.shape),
               "meta": meta, "concepts": []}
        text = json.dumps(doc, indent=1, ensure_ascii=False)
        head, tail = text[: -len("[]\n}")], "\n ]\n}\n"
        if self.n == 0:
            head, tail = text, "\n"
        tmp = self.directory / (JSON_NAME + ".tmp")
        with open(tmp, "w", encoding="utf-8") as out, open(self.part_path, encoding="utf-8") as part:
            out.write(head + ("[\n" if self.n else ""))
            shutil.copyfileobj(part, out)
            out.write(tail)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.directory / JSON_NAME)
        self.part_path.unlink()
        return self.directory

    def close(self) -> None:
        """Drop the unfinished files (after an error)."""
        self.part.close()
        self.tensors.file.close()
        for path in (self.part_path, self.tensors.tmp):
            path.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.close()


@dataclass(frozen=True)
class NamedSummary:
    """What ``cd.name(..., in_memory=False)`` returns: the concept dictionary is on disk at ``path``
    (``cd.load_concepts(path)`` reads it back whole)."""

    path: Path
    n_concepts: int
    dead: int
    """Latents that never fire on the store."""
    meta: dict[str, Any]
    most_frequent: tuple[Concept, ...]
    """The :data:`SUMMARY` most frequent concepts that fire, most frequent first."""

    def __len__(self) -> int:
        return self.n_concepts


class NamedWriter:
    """A naming run's output folder written a block at a time: ``concepts.json``, ``concepts.safetensors``
    (:class:`ConceptsWriter`) and ``report/`` (``naming.reports.report_stream.ReportWriter``: the pages from a spool
    of cards)."""

    def __init__(self, directory: str | Path, n_concepts: int, directions_shape: Sequence[int]) -> None:
        from conceptdict.naming.reports.report_stream import ReportWriter

        self.directory = Path(directory)
        self.concepts = ConceptsWriter(self.directory, n_concepts, directions_shape)
        self.report = ReportWriter(self.directory / "report")
        self.top: list[Concept] = []
        self.dead = 0

    def add(self, concepts: Sequence[Concept], directions: Tensor) -> None:
        self.concepts.add(concepts, directions)
        self.report.add(concepts)
        self.dead += sum(c.frequency <= 0 for c in concepts)
        firing = self.top + [c for c in concepts if c.frequency > 0]
        self.top = sorted(firing, key=lambda c: (-c.frequency, c.id))[:SUMMARY]

    def finish(self, meta: dict[str, Any]) -> NamedSummary:
        self.concepts.finish(meta)
        self.report.finish(meta)
        return NamedSummary(self.directory, len(self.report), self.dead, meta, tuple(self.top))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.concepts.close()
            self.report.close()


def joined_image_meta(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The blocks' image records (``add_image_evidence``'s, {} of a text store) as one: every block's thumbnails in
    context order, the patch grid."""
    if not parts or not parts[0]:
        return {}
    thumbs = {k: v for p in parts for k, v in p["thumbnails"].items()}
    return {"thumbnails": {k: thumbs[k] for k in sorted(thumbs, key=int)}, "patch_grid": parts[0]["patch_grid"]}


def write_named(blocks: Iterable[Any], directory: str | Path, directions_shape: Sequence[int],
                meta: Any) -> NamedSummary:
    """Write ``blocks`` (``pipeline.NamedBlock`` in latent order) into ``directory`` one at a time; ``meta(num_rows,
    image_meta)`` gives the concept dictionary's meta at the end (``pipeline.Naming.meta``)."""
    num_rows, images = 0, []
    with NamedWriter(directory, directions_shape[0], directions_shape) as out:
        for block in blocks:
            out.add(block.concepts, block.directions)
            num_rows = block.num_rows
            images.append(block.image_meta)
        return out.finish(meta(num_rows, joined_image_meta(images)))


__all__ = ["SUMMARY", "ConceptsWriter", "NamedSummary", "NamedWriter", "joined_image_meta", "write_named"]
