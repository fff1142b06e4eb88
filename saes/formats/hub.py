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
    """The local directory of ``hf:REPO[/SUBDIR][@REVISION]``, downloading only that subdirectory if needed; for
    ``hf:REPO[/DIR]/layer_N.safetensors`` (one layer of a circuit-tracer transcoder set) that file and its folder's
    config.yaml, and the file's local path."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, sub, revision = parse(name)
    is_file = bool(sub) and sub.endswith(".safetensors")  # one layer of a set (circuit-tracer's layer_N.safetensors)
    parent = sub.rpartition("/")[0] if is_file else ""
    patterns = ([sub, f"{parent}/config.yaml" if parent else "config.yaml"] if is_file else
                [f"{sub}/*"] if sub else None)
    try:
        root = snapshot_download(repo, revision=revision, allow_patterns=patterns, cache_dir=cache_dir)
    except LocalEntryNotFoundError:
        raise FormatError(f"{name}: repo {repo!r}{f' at {revision}' if revision else ''} is not in the Hugging Face "
                          f"cache and downloading it needs the network (HF_HUB_OFFLINE is set or the hub is "
                          f"unreachable); run once where the hub is reachable, or copy the directory and pass its "
                          f"path") from None
    local = Path(root) / sub if sub else Path(root)
    if not (local.is_file() if is_file else local.is_dir()):
        from huggingface_hub import constants

        what = "file" if is_file else "folder"
        if constants.HF_HUB_OFFLINE:  # the cache holds other folders of the repo; this one may be on the hub
            raise FormatError(f"{name}: {what} {sub!r} of repo {repo!r} is not in the Hugging Face cache and "
                              f"downloading it needs the network (HF_HUB_OFFLINE is set); run once where the hub "
                              f"is reachable, or copy the directory and pass its path")
        raise FormatError(f"{name}: repo {repo!r} has no {what} {sub!r}")
    return local


def push_token(name: str) -> str:
    """The token an upload to ``name`` will use; one-line FormatError for a bad name, offline mode or no login
    (checked before anything is written)."""
    import huggingface_hub
    from huggingface_hub import constants

    parse(name)
    if constants.HF_HUB_OFFLINE:
        raise FormatError(f"--push {name}: uploading needs the network but HF_HUB_OFFLINE is set; unset it and re-run")
    token = huggingface_hub.get_token()
    if not token:
        raise FormatError(f"--push {name}: not logged in to the Hugging Face hub (no token); run `hf auth login` or "
                          f"set HF_TOKEN to a token with write access, then re-run")
    return token


def push(folder: str | Path, name: str, message: str = "Upload with conceptdict export",
         ignore: list[str] | None = None) -> str:
    """Upload ``folder`` (less the files matching ``ignore``) to the hub repo ``hf:OWNER/REPO[/SUBDIR][@REVISION]``
    (the repo is created when missing); returns the commit's URL. One-line FormatError when there is no token,
    the hub is off, or it refuses."""
    import huggingface_hub

    repo, sub, revision = parse(name)
    api = huggingface_hub.HfApi(token=push_token(name))
    try:
        api.create_repo(repo, exist_ok=True)
        info = api.upload_folder(repo_id=repo, folder_path=str(folder), path_in_repo=sub, revision=revision,
                                 commit_message=message, ignore_patterns=ignore)
    except OSError as e:  # HfHubHTTPError and connection errors
        status = getattr(getattr(e, "response", None), "status_code", None)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        fix = ("use a token with write access to that owner" if status in (401, 403)
               else "check the repo name and the network, then re-run")
        raise FormatError(f"--push {name}: the hub refused the upload of {folder}"
                          f"{f' (HTTP {status})' if status else ''}: {first}; {fix}") from None
    return str(getattr(info, "commit_url", "") or f"https://huggingface.co/{repo}")
