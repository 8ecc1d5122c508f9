"""Finding model files: local paths first, the Hugging Face hub as an optional fallback.

``huggingface_hub`` is an optional dependency (``pip install 'kestrel[hub]'``) and is imported
only when a name is not a local path. Every failure (package missing, offline, network error,
unknown repo) becomes a :class:`CheckpointError` whose message says how to pass a local path
instead, so a user without network access always learns what to do.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "CHECKPOINT_FILES",
    "CheckpointError",
    "download_snapshot",
    "hub_offline",
    "looks_like_repo_id",
]

# The files a checkpoint directory holds; only these are downloaded from a model repo (the
# official repo also carries remote-code Python files that Kestrel never runs). The weights are
# one model.safetensors or a sharded set (model-00001-of-00004.safetensors ... and its index).
CHECKPOINT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
    "config.json",
    "tokenizer.json",
)

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
    hint = (
        f"download {what} from https://huggingface.co/{repo_id} into a directory and pass "
        "that directory's path instead of the repo id"
    )
    try:
        import huggingface_hub
    except ImportError as exc:
        raise CheckpointError(
            f"{repo_id!r} is not a local path, and downloading it needs the optional "
            f"huggingface_hub package: pip install 'kestrel[hub]', or {hint}"
        ) from exc
    offline = hub_offline()
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=list(allow_patterns),
            local_files_only=offline,
        )
    except Exception as exc:  # every hub failure gets the same actionable message
        reason = f"{type(exc).__name__}: {str(exc)[:300]}"
        if offline:
            reason = f"HF_HUB_OFFLINE is set and it is not in the local hub cache; {reason}"
        raise CheckpointError(
            f"cannot get {what} of {repo_id!r} from the Hugging Face hub ({reason}); {hint}"
        ) from exc
    return Path(snapshot)
