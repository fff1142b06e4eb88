"""``hf:REPO[/SUBDIR][@REVISION]`` dictionary names: download into the usual Hugging Face cache, read locally.

With ``HF_HUB_OFFLINE=1`` (or no network) the cache is read; a repo that is not there gets an error naming it
and saying that the network is needed.
"""

from __future__ import annotations

import re
from pathlib import Path

from .files import FormatError

PREFIX = "hf:"


def is_hub_name(source: str | Path) -> bool:
    return str(source).startswith(PREFIX)


def parse(name: str) -> tuple[str, str | None, str | None]:
    """``hf:owner/repo/sub/dir@rev`` -> ("owner/repo", "sub/dir", "rev")."""
    m = re.fullmatch(r"hf:([\w.-]+/[\w.-]+)((?:/[^@]+)?)(?:@([\w./-]+))?", name)
    if not m:
        raise FormatError(f"{name!r} is not a hub dictionary name; write hf:OWNER/REPO[/SUBDIR][@REVISION]")
    return m.group(1), (m.group(2).strip("/") or None), m.group(3)


def resolve(name: str, cache_dir: str | Path | None = None) -> Path:
    """The local directory of ``hf:REPO[/SUBDIR][@REVISION]``, downloading only that subdirectory if needed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, sub, revision = parse(name)
    patterns = [f"{sub}/*"] if sub else None
    try:
        root = snapshot_download(repo, revision=revision, allow_patterns=patterns, cache_dir=cache_dir)
    except LocalEntryNotFoundError:
        raise FormatError(f"{name}: repo {repo!r}{f' at {revision}' if revision else ''} is not in the Hugging Face "
                          f"cache and downloading it needs the network (HF_HUB_OFFLINE is set or the hub is "
                          f"unreachable); run once where the hub is reachable, or copy the directory and pass its "
                          f"path") from None
    local = Path(root) / sub if sub else Path(root)
    if not local.is_dir():
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:  # the cache holds other folders of the repo; this one may be on the hub
            raise FormatError(f"{name}: folder {sub!r} of repo {repo!r} is not in the Hugging Face cache and "
                              f"downloading it needs the network (HF_HUB_OFFLINE is set); run once where the hub "
                              f"is reachable, or copy the directory and pass its path")
        raise FormatError(f"{name}: repo {repo!r} has no folder {sub!r}")
    return local
