"""Counting what a code path would ask of a GPU, on any machine: launches, syncs, uploads.

A decode step of a small model is launch- and sync-bound on a GPU, and both are countable
without one. ``LaunchCounter`` is a ``TorchDispatchMode``: inside it every aten op that would
launch a kernel on a CUDA device counts as one launch (views, reshapes, allocations and other
metadata-only ops do not), and the operations that make the host wait for the device count as
syncs: ``_local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``), ``nonzero``, and the
Python-level reads ``Tensor.tolist`` / ``Tensor.numpy`` / ``Tensor.cpu`` (which bypass the
dispatcher, so they are wrapped while the counter is active). Blocking uploads are
``torch.tensor`` / ``torch.as_tensor`` calls with an explicit ``device=`` (a pageable host
buffer copied synchronously on CUDA); ``count_upload`` is how the runtime's non-blocking
uploads (pinned buffer, ``non_blocking=True``) report themselves.

``opaque(name)`` marks a region that is one launch on the GPU (a Triton kernel, or the
FlashAttention binding) but runs as many torch ops on the CPU stand-in: it counts 1 and pauses
counting inside. ``graph_body()`` marks the body of a CUDA graph run eagerly (uncaptured, as on
a CPU): its launches are counted as usual and also into ``graph_body``, and each run counts one
``replays`` (on a GPU the body is one graph launch). ``sites`` names the source line (outside
torch and this module) of every sync and upload, for ``scripts/count_kernels.py --sites``.

A read of a device-to-host copy started earlier (``transfer.Readback``) is a sync only if
nothing was launched after the copy: then the host waits for an empty queue. With more work
queued behind it (the next decode step), the device stays busy while the host reads, and the
read counts as ``deferred_reads`` instead.

The counts describe the CUDA code path only when the code takes it: the caller runs the model
with the branches a GPU would take (the static decode step, the ``fa`` backend with a stand-in
binding); see ``scripts/count_kernels.py``.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LaunchCounter", "active_counter", "count_upload", "graph_body", "opaque"]

aten = torch.ops.aten

# Ops that never launch a kernel: views, shape and metadata changes, allocation without fill.
_NO_LAUNCH = {
    "view",
    "_unsafe_view",
    "reshape",
    "expand",
    "slice",
    "select",
    "as_strided",
    "t",
    "transpose",
    "permute",
    "unsqueeze",
    "squeeze",
    "detach",
    "alias",
    "split",
    "split_with_sizes",
    "unbind",
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "_reshape_alias",
    "unfold",
    "diagonal",
    "narrow",
    "chunk",
    "view_as",
    "expand_as",
    "is_pinned",
    "_pin_memory",
    "pin_memory",
    "set_",
    "resize_",
    "_to_copy_noop",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_same_size",
    "clone_noop",
    "_has_compatible_shallow_copy_type",
    "lift_fresh_copy_noop",
    "record_stream",
}
_SYNC_OPS = {"_local_scalar_dense", "nonzero", "equal"}
_HERE = str(Path(__file__).resolve())
_SKIP = {_HERE, str(Path(__file__).resolve().with_name("transfer.py"))}  # name their callers

_local = threading.local()


def active_counter() -> LaunchCounter | None:
    """The counter active on this thread, if any."""
    return getattr(_local, "counter", None)


def _site() -> str:
    """The innermost stack frame outside torch, this module and ``transfer.py``:
    ``path:line (function)``."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename
        if name in _SKIP or "/torch/" in name or name.startswith("<"):
            continue
        return f"{Path(name).name}:{frame.lineno} ({frame.name})"
    return "?"


class LaunchCounter(TorchDispatchMode):
    """Counts launches, syncs and uploads of the code run inside it (see the module doc)."""

    def __init__(self, *, sites: bool = False) -> None:
        super().__init__()
        self.launches = 0
        self.syncs = 0
        self.uploads_blocking = 0
        self.uploads_nonblocking = 0
        self.deferred_reads = 0
        self.replays = 0  # graph bodies run (``graph_body``): one graph launch each on a GPU
        self.graph_body = 0  # launches inside them
        self.by_op: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()
        self._record_sites = sites
        self._paused = 0
        self._patches: list[tuple[object, str, object]] = []

    # ------------------------------------------------------------------ counting
    def _sync(self, what: str) -> None:
        if self._paused:
            return
        self.syncs += 1
        if self._record_sites:
            self.sites[("sync " + what, _site())] += 1

    def upload(self, blocking: bool) -> None:
        if self._paused:
            return
        if blocking:
            self.uploads_blocking += 1
        else:
            self.uploads_nonblocking += 1
        if self._record_sites:
            kind = "upload (blocking)" if blocking else "upload (non-blocking)"
            self.sites[(kind, _site())] += 1

    def readback(self, launches_at_start: int) -> None:
        """A read of a copy started when ``launches`` was ``launches_at_start``: deferred if
        work was launched since, else a sync (see the module doc)."""
        if self._paused:
            return
        if self.launches > launches_at_start:
            self.deferred_reads += 1
            if self._record_sites:
                self.sites[("read (deferred)", _site())] += 1
        else:
            self._sync("readback")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS:
            self._sync(name)
        if name not in _NO_LAUNCH and name != "_local_scalar_dense":
            self.launches += 1
            self.by_op[name] += 1
        return out

    @contextlib.contextmanager
    def opaque(self, name: str) -> Iterator[None]:
        """One launch (``name``) on the GPU; whatever runs inside is not counted."""
        if not self._paused:
            self.launches += 1
            self.by_op[name] += 1
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def graph_run(self) -> Iterator[None]:
        """One uncaptured run of a CUDA graph's body: its launches also count into
        ``graph_body``, and the run counts one ``replays``."""
        before = self.launches
        try:
            yield
        finally:
            if not self._paused:
                self.graph_body += self.launches - before
                self.replays += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Code that runs only on a CPU (host-side value checks) and not on the GPU path."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def summary(self) -> dict[str, int]:
        return {
            "launches": self.launches,
            "syncs": self.syncs,
            "uploads_blocking": self.uploads_blocking,
            "uploads_nonblocking": self.uploads_nonblocking,
            "deferred_reads": self.deferred_reads,
            "replays": self.replays,
        }

    # ------------------------------------------------------------------ python-level hooks
    def _patch(self, owner: object, attr: str, make) -> None:
        original = getattr(owner, attr)
        self._patches.append((owner, attr, original))
        setattr(owner, attr, make(original))

    def _install(self) -> None:
        counter = self

        def reading(original, what):
            def wrapper(t, *a, **k):
                counter._sync(what)
                with counter.paused():
                    return original(t, *a, **k)

            return wrapper

        def creating(original):
            def wrapper(data, *a, **k):
                if k.get("device") is not None and not isinstance(data, torch.Tensor):
                    counter.upload(blocking=True)
                return original(data, *a, **k)

            return wrapper

        for attr, what in (("tolist", "tolist"), ("numpy", "numpy"), ("cpu", "cpu")):
            self._patch(torch.Tensor, attr, lambda o, w=what: reading(o, w))
        self._patch(torch, "tensor", creating)
        self._patch(torch, "as_tensor", creating)

    def _uninstall(self) -> None:
        while self._patches:
            owner, attr, original = self._patches.pop()
            setattr(owner, attr, original)

    def __enter__(self):
        if active_counter() is not None:
            raise RuntimeError("LaunchCounter does not nest")
        _local.counter = self
        self._install()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._uninstall()
            _local.counter = None


@contextlib.contextmanager
def opaque(name: str) -> Iterator[None]:
    """``LaunchCounter.opaque`` of the active counter; nothing when none is active."""
    counter = active_counter()
    if counter is None:
        yield
        return
    with counter.opaque(name):
        yield


@contextlib.contextmanager
def graph_body() -> Iterator[None]:
    """``LaunchCounter.graph_run`` of the active counter; nothing when none is active. The
    graph sets (``kestrel/runtime/*graphs.py``) run their static step under it when they run it
    eagerly."""
    counter = active_counter()
    if counter is None:
        yield
        return
    with counter.graph_run():
        yield


def count_upload(blocking: bool = False) -> None:
    """Report one host-to-device upload to the active counter (if any)."""
    counter = active_counter()
    if counter is not None:
        counter.upload(blocking)
