"""What a batch job asks: :class:`BatchRequest` values read from a folder of images x a file of
questions, or from a JSONL of ``{"id", "image", "question"}`` (optionally ``"adapter"``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kestrel.errors import InvalidInputError

__all__ = [
    "IMAGE_EXTENSIONS",
    "BatchRequest",
    "check_unique",
    "requests_from_folder",
    "requests_from_jsonl",
]

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".jfif", ".pbm", ".ppm"}
)


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One question about one image. ``image`` is the name written to the output (relative to
    the images folder or the JSONL's folder, as given); ``path`` is the file to open (None: a
    text-only question)."""

    id: str
    image: str | None
    path: Path | None
    question: str
    adapter: str | None = None  # a loaded adapter's name (None: the run's default)


# ---------------------------------------------------------------------------- building requests
def requests_from_folder(images_dir: str | Path, questions_file: str | Path) -> list[BatchRequest]:
    """Every image under ``images_dir`` (recursive, sorted, hidden files skipped) x every
    non-empty line of ``questions_file``; ids are ``<relative image path>#<question index>``."""
    root = Path(images_dir).expanduser()
    if not root.is_dir():
        raise InvalidInputError(f"images folder not found: {images_dir}")
    questions = _read_questions(Path(questions_file).expanduser())
    names = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.suffix.lower() in IMAGE_EXTENSIONS
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
        and p.is_file()
    )
    if not names:
        raise InvalidInputError(
            f"no images under {images_dir} (looked for {', '.join(sorted(IMAGE_EXTENSIONS))})"
        )
    return [
        BatchRequest(f"{name}#{i}", name, root / name, question)
        for name in names
        for i, question in enumerate(questions)
    ]


def _read_lines(path: Path, what: str) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InvalidInputError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cannot read {what} {path}: {exc}") from exc


def _read_questions(path: Path) -> list[str]:
    questions = [q.strip() for q in _read_lines(path, "questions file") if q.strip()]
    if not questions:
        raise InvalidInputError(f"questions file {path} holds no questions (all lines empty)")
    return questions


def requests_from_jsonl(path: str | Path) -> list[BatchRequest]:
    """One request per non-empty line ``{"id", "image", "question"}`` (optionally
    ``"adapter"``: the name of a loaded adapter); ``image`` is a path relative to the JSONL's
    folder (or absolute), or null / absent for a text-only question."""
    path = Path(path).expanduser()
    lines = enumerate(_read_lines(path, "input file"), 1)
    requests = [_request_from_line(ln, f"{path}:{n}", path.parent) for n, ln in lines if ln.strip()]
    if not requests:
        raise InvalidInputError(f"input file {path} holds no requests")
    check_unique(requests)
    return requests


def _request_from_line(line: str, where: str, base: Path) -> BatchRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InvalidInputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    rid, image, question = obj.get("id"), obj.get("image"), obj.get("question")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or str(rid) == "":
        raise InvalidInputError(f'{where}: "id" must be a non-empty string or an integer')
    if not isinstance(question, str) or not question.strip():
        raise InvalidInputError(f'{where}: "question" must be a non-empty string')
    if image is not None and (not isinstance(image, str) or not image):
        raise InvalidInputError(f'{where}: "image" must be a path string or null')
    adapter = obj.get("adapter")
    if adapter is not None and (not isinstance(adapter, str) or not adapter):
        raise InvalidInputError(f'{where}: "adapter" must be an adapter name or null')
    file = None if image is None else base / Path(image).expanduser()
    return BatchRequest(str(rid), image, file, question, adapter)


def check_unique(requests: Sequence[BatchRequest]) -> None:
    seen: set[str] = set()
    for r in requests:
        if r.id in seen:
            raise InvalidInputError(f"request id {r.id!r} appears more than once")
        seen.add(r.id)
