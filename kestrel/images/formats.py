"""The encoded image formats Kestrel decodes, and how an unaccepted one is refused.

``ACCEPTED_FORMATS`` (PIL's names; MPO is a JPEG carrying extra pictures, as phones write it)
are the only readers ``Image.open`` tries on an encoded input. Anything else is refused by name
before a decoder runs: PIL would hand PostScript to Ghostscript, a subprocess that a request
body must never start, and its rarer readers are more attack surface than anyone sends images
in. To name a refused format its header is read by PIL's full set of readers (identification
only: nothing is decoded, so no decoder or helper process runs).
"""

from __future__ import annotations

import functools
import io
from pathlib import Path

from PIL import Image

__all__ = ["ACCEPTED_FORMATS", "accepted_readers", "stream", "unaccepted"]

ACCEPTED_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF")


@functools.cache
def accepted_readers() -> tuple[str, ...]:
    """The accepted formats this PIL reads (its plugins registered first: PIL loads most of
    them lazily)."""
    Image.init()
    return tuple(f for f in ACCEPTED_FORMATS if f in Image.OPEN)


def stream(source: bytes | Path):
    return io.BytesIO(source) if isinstance(source, bytes) else source


def unaccepted(source: bytes | Path, what: str) -> str:
    """Why ``source`` is refused: the format its header names, if any reader knows it."""
    accepted = ", ".join(ACCEPTED_FORMATS)
    try:
        with Image.open(stream(source)) as image:
            found = image.format
    except Exception:  # any reader's failure: the format is unknown
        found = None
    if found is None:
        return f"cannot decode {what} as an image: not a format Kestrel reads ({accepted})"
    return f"{what} is {found}, which Kestrel does not decode; send one of {accepted}"
