"""Finding model files: local paths first, the Hugging Face hub as an optional fallback.

``huggingface_hub`` is an optional dependency (``pip install 'kestrel[hub]'``) and is imported
only when a name is not a local path. Every failure (package missing, offline, network error,
unknown repo) becomes a :class:`CheckpointError` whose message says how to pass a local path
instead, so a user without network access always learns what to do.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path, PureWindowsPath
from types import ModuleType

__all__ = [
    "CHECKPOINT_FILES",
    "CheckpointError",
    "checkpoint_patterns",
    "download_checkpoint",
    "download_snapshot",
    "hub_offline",
    "index_shards",
    "looks_like_repo_id",
]

# The files a checkpoint directory holds; only these are downloaded from a model repo (the
# official repo also carries remote-code Python files that Kestrel never runs). The weights are
# one model.safetensors or a sharded set (model.safetensors.index.json and the shards its
# weight_map names, e.g. model-00001-of-00004.safetensors; never a pattern, since a repo may
# carry several shard sets and only the indexed one is read);
# Moondream 3 preview also publishes its FP8 experts as a torch pickle, model_fp8.pt, which is
# fetched only when the repo has no safetensors form or when FP8 is asked for.
SINGLE_FILE = ("model.safetensors",)
INDEX_FILE = "model.safetensors.index.json"
SHARDED = (INDEX_FILE, "*.safetensors")  # the shards are fetched by the index's names
FP8_PT = ("model_fp8.pt",)
COMPANIONS = ("config.json", "tokenizer.json")
CHECKPOINT_FILES = (*SINGLE_FILE, *SHARDED, *COMPANIONS)

# "owner/name" with the characters the hub allows; a leading dot or slash means a local path.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CheckpointError(ValueError):
    """A checkpoint (or tokenizer) that cannot be found, read, or matched to the config."""


def looks_like_repo_id(name: str) -> bool:
    """True for ``owner/name`` strings (the hub's repo id form), False for other paths."""
    return bool(_REPO_ID.match(name)) and ".." not in name


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` read at call time (huggingface_hub itself reads it at import time)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def checkpoint_patterns(repo_files: Sequence[str], *, prefer_fp8: bool = False) -> tuple[str, ...]:
    """The files to fetch of a repo holding ``repo_files``: one weights form, as the loader reads
    it -- ``model.safetensors`` when present (a repo may carry the shards too), else the index
    (its shards' patterns are stand-ins: ``download_checkpoint`` replaces them by the names the
    index lists), else ``model_fp8.pt`` (``prefer_fp8``: ``model_fp8.pt`` first) -- plus
    config.json and tokenizer.json. A repo with none of them gets every pattern (nothing of the
    weights matches; the loader then names what is missing)."""
    forms = (SINGLE_FILE, SHARDED, FP8_PT)
    for form in (FP8_PT, *forms[:2]) if prefer_fp8 else forms:
        if fnmatch.filter(repo_files, form[0]):
            return (*form, *COMPANIONS)
    return CHECKPOINT_FILES


def download_snapshot(
    repo_id: str,
    *,
    revision: str | None,
    allow_patterns: Sequence[str],
    what: str,
) -> Path:
    """Return the local snapshot directory of ``repo_id`` (downloaded or from the hub cache).

    ``what`` names the files in error messages (e.g. "model.safetensors and config.json").
    Offline (``HF_HUB_OFFLINE=1``) only the local hub cache is consulted.
    Raises CheckpointError when huggingface_hub is missing or the snapshot cannot be had.
    """
    hub = _import_hub(repo_id, what)
    offline = hub_offline()
    with _hub_errors(repo_id, what, offline):
        return _snapshot(hub, repo_id, revision, allow_patterns, offline)


def download_checkpoint(
    repo_id: str, *, revision: str | None, what: str, prefer_fp8: bool = False
) -> Path:
    """``download_snapshot`` of a checkpoint, fetching one weights form: the repo's file list
    is read first and ``checkpoint_patterns`` chooses. A sharded form is fetched by its index:
    the index alone first, then exactly the shards its ``weight_map`` names (whatever their
    names: a repo may carry several shard sets, and only the indexed one is fetched). Offline
    the cache holds whatever was fetched before, so every checkpoint pattern is asked of it.
    Either way a sharded snapshot is returned only once every shard its index names is there;
    an index naming a file the repo lacks, or a path outside the snapshot, is refused before
    any shard is downloaded."""
    hub = _import_hub(repo_id, what)
    offline = hub_offline()
    with _hub_errors(repo_id, what, offline):
        patterns = CHECKPOINT_FILES  # offline the cache's snapshot is returned as it is
        if not offline:
            listing = hub.list_repo_files(repo_id, revision=revision)
            patterns = checkpoint_patterns(listing, prefer_fp8=prefer_fp8)
            if patterns[0] == INDEX_FILE:
                index = _snapshot(hub, repo_id, revision, (INDEX_FILE,), offline) / INDEX_FILE
                shards = index_shards(index, listing)
                patterns = (INDEX_FILE, *map(_literal, shards), *COMPANIONS)
        snapshot = _snapshot(hub, repo_id, revision, patterns, offline)
    if _reads_the_index(snapshot, patterns, prefer_fp8):
        _check_complete(snapshot, repo_id, offline)
    return snapshot


def _reads_the_index(snapshot: Path, patterns: Sequence[str], prefer_fp8: bool) -> bool:
    """Whether the loader will read ``snapshot`` by its index (the form fetched, or offline the
    form the cache holds, as ``shards.ShardSet.locate`` and ``prefer_fp8`` choose)."""
    if patterns[0] != INDEX_FILE and patterns != CHECKPOINT_FILES:
        return False  # online, another form was fetched
    if prefer_fp8 and (snapshot / FP8_PT[0]).is_file():
        return False
    return not (snapshot / SINGLE_FILE[0]).is_file() and (snapshot / INDEX_FILE).is_file()


def index_shards(index: Path, listing: Sequence[str] | None = None) -> tuple[str, ...]:
    """The shard file names a ``model.safetensors.index.json`` names, in order. Each must be a
    plain file name beside the index (no folder, no ``..``, not absolute) and, given the repo's
    ``listing``, a file of the repo. Raises CheckpointError naming the offending entry."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map is empty or not an object")
        names = sorted({v for v in weight_map.values()}, key=str)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read the shard index {index}: {exc}") from exc
    present = None if listing is None else set(listing)
    for name in names:
        if not _plain_name(name):
            raise CheckpointError(
                f"{index.name} names the shard {name!r}, which is not a file name beside the "
                "index (a folder, '..' or an absolute path): refused, nothing was loaded"
            )
        if present is not None and name not in present:
            raise CheckpointError(
                f"{index.name} names the shard {name!r}, which the repo does not have; "
                "nothing was downloaded"
            )
    return tuple(names)


def _plain_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in ("/", "\\", "\0"))
        and not PureWindowsPath(name).drive
    )


def _literal(name: str) -> str:
    """An allow-pattern matching exactly ``name`` (fnmatch's wildcards bracketed)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _check_complete(snapshot: Path, repo_id: str, offline: bool) -> None:
    """A sharded snapshot must hold every shard its index names (a download that stopped
    midway, or an offline cache that holds another shard set, is not loaded)."""
    index = snapshot / INDEX_FILE
    missing = [n for n in index_shards(index) if not (snapshot / n).is_file()]
    if missing:
        where = "the local hub cache" if offline else "the download"
        raise CheckpointError(
            f"{where} of {repo_id!r} lacks {len(missing)} shard(s) its {INDEX_FILE} names "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); nothing was "
            f"loaded: {'go online and load it again, or ' if offline else ''}"
            f"{_hint(repo_id, 'the index and its shards')}"
        )


def _snapshot(hub, repo_id: str, revision, patterns: Sequence[str], offline: bool) -> Path:
    return Path(
        hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=list(patterns), local_files_only=offline
        )
    )


def _hint(repo_id: str, what: str) -> str:
    return (
        f"download {what} from https://huggingface.co/{repo_id} into a directory and pass "
        "that directory's path instead of the repo id"
    )


def _import_hub(repo_id: str, what: str) -> ModuleType:
    try:
        import huggingface_hub
    except ImportError as exc:
        raise CheckpointError(
            f"{repo_id!r} is not a local path, and downloading it needs the optional "
            f"huggingface_hub package: pip install 'kestrel[hub]', or {_hint(repo_id, what)}"
        ) from exc
    return huggingface_hub


@contextmanager
def _hub_errors(repo_id: str, what: str, offline: bool) -> Iterator[None]:
    """Every hub failure (listing or download) gets the same actionable message."""
    try:
        yield
    except CheckpointError:
        raise  # already says what is wrong (a hostile or incomplete index)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {str(exc)[:300]}"
        if offline:
            reason = f"HF_HUB_OFFLINE is set and it is not in the local hub cache; {reason}"
        raise CheckpointError(
            f"cannot get {what} of {repo_id!r} from the Hugging Face hub ({reason}); "
            f"{_hint(repo_id, what)}"
        ) from exc
