"""Crop worker processes: started ahead of the first request (``ensure``; or on demand), one
request at a time each, shared by every crop pool of the process, kept while idle and stopped
at exit (``worker.py`` is what each one runs; ``pool.py`` hands them images)."""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import threading

from kestrel.crops.worker import NOT_MAPPED, command

__all__ = ["WORKERS", "CropWorkerError", "WorkerGone", "processes_supported"]


def processes_supported() -> bool:
    """Crop worker processes need Linux's memfd_create and descriptor passing."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


class CropWorkerError(RuntimeError):
    """A worker process answered a request with an error. The pixels were checked before they
    were sent, so the fault is the worker's (its libvips, its pyvips), never the image's."""


class WorkerGone(RuntimeError):
    """The worker process is not there (did not start, exited, closed its socket)."""


class _Worker:
    """One crop worker process and our end of its socket; one request at a time."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            fd = theirs.fileno()
            self.proc = subprocess.Popen(command(fd), pass_fds=[fd], stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.mapped: dict[int, int] = {}  # arena slot -> the generation this worker mapped
        self._pending: tuple[bytes, int, tuple[int, int] | None, bool] | None = None

    def send(self, message: bytes, fd: int, arena: tuple[int, int] | None = None) -> None:
        """Send one request (``finish`` waits for its reply); ``arena`` = (slot, generation)
        when ``fd`` is a reused arena's, whose descriptor goes only to a worker that has not
        mapped that generation yet (and again, once, if the worker says it has not)."""
        send_fd = arena is None or self.mapped.pop(arena[0], None) != arena[1]
        self._pending = (message, fd, arena, send_fd)
        self._send(message, fd if send_fd else None)

    def finish(self) -> None:
        """Wait for the reply to the request ``send`` sent; CropWorkerError if it failed."""
        if self._pending is None:
            raise RuntimeError("finish() without a request sent")
        (message, fd, arena, send_fd), self._pending = self._pending, None
        reply = self._recv()
        if reply == NOT_MAPPED and not send_fd:
            self._send(message, fd)
            reply = self._recv()
        if arena is not None and reply == b"ok":
            self.mapped[arena[0]] = arena[1]
        if reply != b"ok":
            raise CropWorkerError(reply.decode(errors="replace").removeprefix("error: "))

    def _send(self, message: bytes, fd: int | None) -> None:
        try:
            if fd is not None:
                socket.send_fds(self.sock, [message], [fd])
            else:
                self.sock.sendall(message)
        except OSError as exc:
            raise WorkerGone(f"the crop worker process is gone: {exc}") from exc

    def _recv(self) -> bytes:
        try:
            reply = self.sock.recv(1 << 16)
        except OSError as exc:
            raise WorkerGone(f"the crop worker process is gone: {exc}") from exc
        if not reply:
            raise WorkerGone("the crop worker process exited")
        return reply

    def stop(self) -> None:
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class _Workers:
    """The process's crop workers, shared by every pool: started on demand, kept while idle,
    stopped at exit."""

    def __init__(self) -> None:
        self._forget()
        atexit.register(self.stop_all)
        if hasattr(os, "register_at_fork"):  # a forked child must not talk to our workers
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        for worker in getattr(self, "_all", ()):
            worker.sock.close()  # this process's copy; the worker stays its parent's
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()

    def ensure(self, count: int) -> int:
        """Start idle workers until the process has ``count`` (``pool.start_workers``:
        ahead of the first request, so none waits for a worker's ~80 ms of imports); returns
        how many it started. One that cannot start ends the attempt: requests then start
        their own."""
        started = 0
        while True:
            with self._lock:
                if len(self._all) >= count:
                    return started
            try:
                worker = self._start()
            except WorkerGone:
                return started
            self._give_back(worker)
            started += 1

    def run_all(self, jobs: list[tuple[bytes, int, tuple[int, int] | None]]) -> None:
        """Each (message, fd, arena) of ``jobs`` to an idle worker of its own (started if none
        is; ``_Worker.send`` for ``arena``), all sent before any reply is awaited, so they run
        at once with no thread of ours per job. Returns when every worker that got one has
        answered; raises the first error."""
        sent: list[_Worker] = []
        errors: list[BaseException] = []
        for message, fd, arena in jobs:
            try:
                worker = self._take()
            except WorkerGone as exc:
                errors.append(exc)
                break
            try:
                worker.send(message, fd, arena)
                sent.append(worker)
            except BaseException as exc:  # gone: never reuse it
                self._discard(worker)
                errors.append(exc)
                break
        for worker in sent:  # every sent job ends before the caller lets its memory go
            try:
                worker.finish()
            except CropWorkerError as exc:  # it failed this request; the process is fine
                self._give_back(worker)
                errors.append(exc)
            except BaseException as exc:  # gone, or interrupted mid-request
                self._discard(worker)
                errors.append(exc)
            else:
                self._give_back(worker)
        if errors:
            raise errors[0]

    def _take(self) -> _Worker:
        """An idle worker whose process is still running (those that exited are let go), or
        a new one."""
        while True:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None or worker.proc.poll() is None:
                break
            self._discard(worker)
        return worker if worker is not None else self._start()

    def _start(self) -> _Worker:
        """A new worker, counted among the process's (not yet idle)."""
        try:
            worker = _Worker()
        except OSError as exc:
            raise WorkerGone(f"cannot start a crop worker process: {exc}") from exc
        with self._lock:
            self._all.add(worker)
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._all.discard(worker)
        worker.stop()

    def stop_all(self) -> None:
        with self._lock:
            workers, self._all, self._idle = list(self._all), set(), []
        for w in workers:
            w.stop()


WORKERS = _Workers()
