"""Release names of published dictionaries: ``RELEASE/SAE_ID`` -> ``hf:REPO/PATH`` (then read as any hub name).

The names are SAELens's (``gpt2-small-res-jb/blocks.8.hook_resid_pre`` is ``SAE.from_pretrained(release=
"gpt2-small-res-jb", sae_id="blocks.8.hook_resid_pre")``). The directory is sae-lens's own
``pretrained_saes.yaml`` when ``sae_lens`` is importable (every release it knows), else :data:`RELEASES`, a few
well-known releases whose files this project reads (SAELens layout or Gemma Scope's ``params.npz``). An entry
maps each SAE id to its path in the repo, either listed or, for Gemma Scope, any id of the form ``id_pattern``
(the id is the path). :func:`resolve` is the pure mapping; :func:`directory` picks the registry.
"""

from __future__ import annotations

import difflib
import importlib
import re
from typing import NamedTuple

from .files import FormatError
from .hub import PREFIX


class Release(NamedTuple):
    """One release: its hub repo, SAE id -> path in the repo, and the pattern of ids whose path is the id."""

    repo_id: str
    saes: dict[str, str]
    id_pattern: str | None = None
    model: str = ""


def _layers(template: str, n: int) -> dict[str, str]:
    return {template.format(i): template.format(i) for i in range(n)}


_GEMMA_SCOPE = r"layer_\d+/width_\d+[km]/average_l0_\d+"
RELEASES: dict[str, Release] = {
    "gpt2-small-res-jb": Release("jbloom/GPT2-Small-SAEs-Reformatted",
                                 {**_layers("blocks.{}.hook_resid_pre", 12),
                                  "blocks.11.hook_resid_post": "blocks.11.hook_resid_post"}, model="gpt2-small"),
    "gpt2-small-res-jb-feature-splitting": Release(
        "jbloom/GPT2-Small-Feature-Splitting-Experiment-Layer-8",
        {f"blocks.8.hook_resid_pre_{w}": f"blocks.8.hook_resid_pre_{w}"
         for w in (768, 1536, 3072, 6144, 12288, 24576, 49152, 98304)}, model="gpt2-small"),
    "gemma-2b-res-jb": Release("jbloom/Gemma-2b-Residual-Stream-SAEs", {
        "blocks.0.hook_resid_post": "gemma_2b_blocks.0.hook_resid_post_16384_anthropic",
        "blocks.6.hook_resid_post": "gemma_2b_blocks.6.hook_resid_post_16384_anthropic_fast_lr",
        "blocks.10.hook_resid_post": "gemma_2b_blocks.10.hook_resid_post_16384",
        "blocks.12.hook_resid_post": "gemma_2b_blocks.12.hook_resid_post_16384",
        "blocks.17.hook_resid_post": "gemma_2b_blocks.17.hook_resid_post_16384"}, model="gemma-2b"),
    **{f"gemma-scope-{size}-pt-{site}": Release(f"google/gemma-scope-{size}-pt-{site}", {}, _GEMMA_SCOPE,
                                                 model=f"gemma-2-{size}")
       for size in ("2b", "9b") for site in ("res", "mlp", "att")},
}
"""The releases known without sae-lens (docs/guide/foreign-dictionaries.md lists them)."""


def sae_lens_directory() -> dict[str, Release] | None:
    """sae-lens's release directory (its ``pretrained_saes.yaml``) as :class:`Release` entries, or None when
    sae_lens is not installed (sae-lens 6: ``sae_lens.loading``; earlier: ``sae_lens.toolkit``)."""
    for module in ("sae_lens.loading.pretrained_saes_directory", "sae_lens.toolkit.pretrained_saes_directory"):
        try:
            lookup = importlib.import_module(module).get_pretrained_saes_directory()
        except (ImportError, AttributeError):
            continue
        return {name: Release(str(e.repo_id), dict(e.saes_map), model=str(getattr(e, "model", "") or ""))
                for name, e in lookup.items()}
    return None


def directory() -> tuple[dict[str, Release], str]:
    """(registry, where it comes from): sae-lens's when installed, else :data:`RELEASES`."""
    found = sae_lens_directory()
    if found:
        return found, "sae-lens's pretrained_saes.yaml"
    return RELEASES, "conceptdict's own short list (install sae-lens for every release)"


def release_of(name: str) -> str:
    """The release part of ``RELEASE/SAE_ID``."""
    return str(name).split("/", 1)[0]


def resolve(name: str, registry: dict[str, Release], where: str = "the release list") -> str:
    """``RELEASE/SAE_ID`` -> ``hf:REPO/PATH`` (``hf:REPO`` when the path is the repo's root). FormatError naming
    the closest releases (or SAE ids) when ``name`` is not in ``registry``."""
    release, _, sae_id = str(name).partition("/")
    entry = registry.get(release)
    if entry is None:
        close = difflib.get_close_matches(release, list(registry), n=5, cutoff=0.5)
        hint = f"closest releases: {', '.join(close)}" if close else f"{len(registry)} releases known"
        raise FormatError(f"{name!r} is neither an existing directory nor a known dictionary release in {where} "
                          f"({hint}); pass a directory, hf:OWNER/REPO[/SUBDIR] or RELEASE/SAE_ID")
    if not sae_id:
        raise FormatError(f"{name!r} names the release {release!r} but no SAE; write {release}/SAE_ID, e.g. "
                          f"{release}/{next(iter(entry.saes), '<id>')}")
    path = entry.saes.get(sae_id)
    if path is None and entry.id_pattern and re.fullmatch(entry.id_pattern, sae_id):
        path = sae_id
    if path is None:
        close = difflib.get_close_matches(sae_id, list(entry.saes), n=5, cutoff=0.5)
        known = ", ".join(close or list(entry.saes)[:5]) or f"ids of the form {entry.id_pattern}"
        raise FormatError(f"release {release!r} has no SAE {sae_id!r}; {'closest' if close else 'e.g.'}: {known}")
    path = path.strip("/")
    return f"{PREFIX}{entry.repo_id}" + (f"/{path}" if path and path != "." else "")


def looks_like_release(source: str) -> bool:
    """True for a relative ``NAME/...`` that could be ``RELEASE/SAE_ID`` (the caller checked it is no path)."""
    text = str(source)
    return "/" in text and not text.startswith(("/", ".", "~", PREFIX)) and bool(re.match(r"[\w.-]+/", text))
