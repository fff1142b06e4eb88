"""A concept dictionary on disk read a block of concepts at a time (``conceptdict score`` of a dictionary whose
records do not fit in memory).

:class:`ConceptsFile` reads ``concepts.json`` as a stream: its head (format version, count, meta) first, then its
``concepts`` array one record at a time (``json.JSONDecoder.raw_decode`` over a buffer of :data:`CHUNK`
characters, never the whole text), and each block's directions from ``concepts.safetensors`` at the offsets its
header names (``saes.lazy_io.WeightsFile``). Any JSON layout of the file is read; the one ``naming.written`` writes
(meta before the concepts) is read without parsing the concepts twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from torch import Tensor

from .concepts import (
    FORMAT_VERSION,
    JSON_NAME,
    TENSORS_NAME,
    Concept,
    concept_from_json,
)

CHUNK = 1 << 20
"""Characters of concepts.json read at a time."""

HEAD = ("format_version", "n_concepts", "directions_shape", "meta")
"""The keys of concepts.json besides its concepts."""


class _Stream:
    """JSON values read one at a time from a text file, through a buffer."""

    def __init__(self, f: IO[str], where: Path) -> None:
        self.f, self.where, self.buf, self.pos, self.eof = f, where, "", 0, False
        self.decoder = json.JSONDecoder()

    def _fill(self) -> None:
        data = self.f.read(CHUNK)
        self.eof = not data
        self.buf, self.pos = self.buf[self.pos:] + data, 0

    def peek(self) -> str:
        """The next character that is not white space ("" at the end of the file)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or self.eof:
                return self.buf[self.pos: self.pos + 1]
            self._fill()

    def take(self, allowed: str) -> str:
        c = self.peek()
        if not c or c not in allowed:
            raise ValueError(f"{self.where} is not a concept dictionary's JSON: expected one of {allowed!r} at "
                             f"{c!r}; re-run `conceptdict name`, or restore the file")
        self.pos += 1
        return c

    def value(self) -> Any:
        """The next JSON value (the buffer grows until it holds all of it, and a character after it)."""
        self.peek()
        while True:
            try:
                v, end = self.decoder.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof:
                    self.pos = end
                    return v
            except json.JSONDecodeError as e:
                if self.eof:
                    raise ValueError(f"{self.where} is not valid JSON ({e}); the concept dictionary is damaged: re-run "
                                     "`conceptdict name`, or restore the file") from None
            self._fill()


def _items(path: Path) -> Iterator[tuple[str, Any]]:
    """(key, value) of concepts.json's top-level keys, and ("concept", record) for each record of its concepts."""
    with open(path, encoding="utf-8") as f:
        s = _Stream(f, path)
        s.take("{")
        while s.peek() != "}":
            key = s.value()
            s.take(":")
            if key == "concepts":
                s.take("[")
                while s.peek() != "]":
                    yield "concept", s.value()
                    if s.peek() == ",":
                        s.take(",")
                s.take("]")
            else:
                yield key, s.value()
            if s.peek() == ",":
                s.take(",")
        s.take("}")


class ConceptsFile:
    """``directory``'s concept dictionary (written by ``conceptdict name``), read a block of concepts at a time:
    :attr:`meta`, :attr:`n_concepts` and :attr:`directions_shape` from its head, :meth:`blocks` its concepts in
    order, :meth:`directions` a range of its directions."""

    def __init__(self, directory: str | Path) -> None:
        from conceptdict.saes.lazy_io import WeightsFile

        self.directory = Path(directory)
        self.json_path = self.directory / JSON_NAME
        if not self.json_path.exists():
            raise FileNotFoundError(f"{directory} has no {JSON_NAME}; pass a concept dictionary directory written by "
                                    f"`conceptdict name`")
        head: dict[str, Any] = {}
        items = _items(self.json_path)
        for key, value in items:
            if key == "concept" and all(k in head for k in HEAD):
                break
            if key != "concept":
                head[key] = value
        items.close()
        if head.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{self.json_path} has format_version={head.get('format_version')!r}; this conceptdict "
                             f"reads version {FORMAT_VERSION}")
        self.meta: dict[str, Any] = head.get("meta", {})
        self.tensors = WeightsFile(self.directory / TENSORS_NAME)
        self.directions_shape = tuple(self.tensors.tensors["directions"][1])
        self.n_concepts = int(head.get("n_concepts", self.directions_shape[0]))
        if self.directions_shape[0] != self.n_concepts:
            raise ValueError(f"{self.json_path} says n_concepts={self.n_concepts} but {self.directory / TENSORS_NAME} "
                             f"holds {self.directions_shape[0]} directions; the concept dictionary is damaged: re-run "
                             f"`conceptdict name`, or restore both files")

    def directions(self, start: int, stop: int) -> Tensor:
        """Directions of concepts ``[start, stop)``."""
        return self.tensors.read("directions", 0, start, stop)

    def concepts(self, size: int) -> Iterator[list[Concept]]:
        """The concepts, ``size`` at a time, in order (their directions unread): one block in memory. A record that is
        not a concept, out of order, or a count that is not :attr:`n_concepts` is a ValueError naming the file."""
        block: list[Concept] = []
        done = 0
        for key, record in _items(self.json_path):
            if key != "concept":
                continue
            at = done + len(block)
            try:
                concept = concept_from_json(record)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{self.json_path}: concept record {at} is damaged ({type(e).__name__}: {e}); re-run "
                                 f"`conceptdict name`, or restore the file") from None
            if concept.id != at:
                raise ValueError(f"{self.json_path}: concept record {at} has id {concept.id}; the concept dictionary "
                                 f"is damaged (its records must be latents 0, 1, ... in order): re-run `conceptdict "
                                 f"name`, or restore the file")
            block.append(concept)
            if len(block) == size:
                yield block
                done += size
                block = []
        if block:
            yield block
            done += len(block)
        if done != self.n_concepts:
            raise ValueError(f"{self.json_path} holds {done} concepts but says n_concepts={self.n_concepts}; the "
                             f"concept dictionary is damaged: re-run `conceptdict name`, or restore the file")

    def blocks(self, size: int) -> Iterator[tuple[list[Concept], Tensor]]:
        """(concepts, their directions) of ``size`` concepts at a time, in order: one block in memory."""
        done = 0
        for block in self.concepts(size):
            yield block, self.directions(done, done + len(block))
            done += len(block)


__all__ = ["ConceptsFile"]
