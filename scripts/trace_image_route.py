"""Follow one image from ``Engine.query`` to the vision encoder, as the program runs.

    python scripts/trace_image_route.py [--model DIR]   # (--smoke: the same, already small)

Profiles every Python call inside the ``kestrel`` package while one query about an uncached
image runs, and keeps the calls that receive the image or something carrying it (the decoded
pixels, the prepared image, a request, draft or sequence whose ``image`` is one of those or whose
``images`` tuple holds one, and
the pixels a call given a carrier returns: crops, normalized tensors). It
prints the modules in the order the image enters them (consecutive calls in one module are one
stay) up to the first call of the vision encoder, then how many modules were entered and how
many times the route came back to a module it had left. A method called on a carrier itself
(``self``) is not a step: reading a request's own fields moves the image nowhere.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kestrel  # noqa: E402

PACKAGE = Path(kestrel.__file__).parent
ENCODER = ("runtime/runtime.py", "encode_image")  # where the runtime runs the encoder


def _is_image_data(value: object) -> bool:
    """Pixels in some form: an array or tensor, or a value holding ``pixels`` / ``crops``."""
    kind = type(value).__name__
    return kind in ("ndarray", "Tensor") or hasattr(value, "pixels") or hasattr(value, "crops")


class Route:
    """The modules the image's carriers are passed into, in order."""

    def __init__(self, image: object) -> None:
        self.carriers: dict[int, object] = {id(image): image}
        self.stays: list[str] = []
        self.calls: list[list[str]] = []  # the functions of each stay
        self.frames: dict[int, bool] = {}
        self.armed = False  # set when the query starts; the engine's own setup is not traced
        self.done = False

    def _carries(self, value: object) -> bool:
        if id(value) in self.carriers:
            return True
        if isinstance(value, type):
            return False
        for attr in ("image", "pixels", "images"):
            inner = getattr(value, attr, None)
            # a conversation's images come as a tuple (``state.images``, a request's tuple)
            inners = inner if isinstance(inner, tuple) else (inner,)
            if any(i is not None and id(i) in self.carriers for i in inners):
                self.carriers[id(value)] = value
                return True
        if isinstance(value, (tuple, list)) and any(id(i) in self.carriers for i in value):
            self.carriers[id(value)] = value
            return True
        return False

    def _adopt(self, value: object) -> None:
        """A value derived from a carrier (the pixels of a prepared image) carries it too."""
        for attr in ("pixels", "crops"):
            inner = getattr(value, attr, None)
            if inner is not None:
                self.carriers.setdefault(id(inner), inner)

    def profile(self, frame, event: str, arg: object) -> None:
        if self.done or not self.armed:
            return
        if event == "return":  # what a call that got a carrier returns carries it too
            if self.frames.pop(id(frame), False) and _is_image_data(arg):
                self.carriers.setdefault(id(arg), arg)
                self._adopt(arg)
            return
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if PACKAGE not in path.parents:
            return
        names = frame.f_code.co_varnames[: frame.f_code.co_argcount]
        # a method of a carrier reading its own fields (``request.pages_needed()``) does not
        # move the image anywhere: ``self`` is not followed
        args = [frame.f_locals[n] for n in names if n != "self"]
        if not any(self._carries(a) for a in args if a is not None):
            return
        for a in args:
            if a is not None and id(a) in self.carriers:
                self._adopt(a)
        self.frames[id(frame)] = True
        module = path.relative_to(PACKAGE).as_posix()
        if not self.stays or self.stays[-1] != module:
            self.stays.append(module)
            self.calls.append([])
        name = frame.f_code.co_qualname
        if name not in self.calls[-1]:
            self.calls[-1].append(name)
        if (module, frame.f_code.co_name) == ENCODER:
            self.done = True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    p.add_argument("--smoke", action="store_true", help="the default run: one small query")
    args = p.parse_args(argv)
    from PIL import Image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8))
    route = Route(image)
    threading.setprofile(route.profile)  # the scheduler thread starts inside Engine()
    try:
        with kestrel.Engine(args.model, device="cpu") as engine:
            sys.setprofile(route.profile)
            route.armed = True
            engine.query(image, "What is this?", settings={"max_tokens": 1})
            route.armed = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    seen: set[str] = set()
    returns = 0
    for i, (module, calls) in enumerate(zip(route.stays, route.calls, strict=True), 1):
        back = module in seen
        returns += back
        seen.add(module)
        print(f"{i:2d}. {module:<28} {', '.join(calls)}{'   (back)' if back else ''}")
    if not route.done:
        print("the vision encoder was not reached (a cached image?)")
    print(f"modules entered: {len(seen)}; returns to a module already left: {returns}")


if __name__ == "__main__":
    main()
