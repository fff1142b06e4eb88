"""The objects the API returns, taken back wherever their folder is: a dictionary (:class:`SparseCoder`), a store
(:class:`ActivationStore`), a concept dictionary (:class:`ConceptDictionary`), a CBM (:class:`CbmResult`). Each
remembers its folder (``.path``) when it has one: the folder it was loaded from or written to. A path setting takes
either (``conceptdict.settings.home_of``); one made in memory works where nothing reads its files."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:  # names only: importing the stages here would slow `import conceptdict.train_api`
    from conceptdict.activations.store import ActivationStore
    from conceptdict.naming.bottleneck.cbm import CbmResult
    from conceptdict.naming.concepts import ConceptDictionary
    from conceptdict.saes.model import SparseCoder

PathLike = Union[str, Path]
DictionaryLike = Union[str, Path, "SparseCoder"]
"""A dictionary: its folder (any format ``cd.load`` reads), a hub name, or a SparseCoder."""
StoreLike = Union[str, Path, "ActivationStore"]
"""An activation store: its folder or the opened store."""
ConceptsLike = Union[str, Path, "ConceptDictionary"]
"""A concept dictionary: its folder or the object ``cd.name`` / ``cd.load_concepts`` returned."""
CbmLike = Union[str, Path, "CbmResult"]
"""A concept bottleneck model: its folder or the object ``cd.cbm`` returned."""

__all__ = ["CbmLike", "ConceptsLike", "DictionaryLike", "PathLike", "StoreLike"]
