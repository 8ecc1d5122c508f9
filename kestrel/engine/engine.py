"""Engine: the public API. One scheduler thread owns the runtime, the page table and the cache.

Callers on any thread (or event loop) validate, decode and hash their input on their own
thread, then hand a request to the scheduler thread through one inbox queue and wait on a
``concurrent.futures.Future`` (or iterate a stream). The scheduler thread is the only one that
touches the model, the KV pages and the prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kestrel.engine.adapters import AdapterRegistry
from kestrel.engine.calls import SkillCalls
from kestrel.engine.desk import Drafter, Submitter
from kestrel.engine.intake import budget_bytes, intake
from kestrel.engine.options import EngineOptions, takes_options
from kestrel.engine.replies import ReplyMemory
from kestrel.engine.requests import RequestFactory
from kestrel.engine.setup import load_runtime
from kestrel.errors import InvalidInputError
from kestrel.images import PreparedImage, prepare_image
from kestrel.results import EngineStats
from kestrel.runtime.executor import BatchExecutor
from kestrel.runtime.heads import ModelHeads
from kestrel.scheduler import Scheduler
from kestrel.scheduler.loop import SchedulerLoop

__all__ = ["Engine"]


class Engine(SkillCalls):
    """Serve a Moondream checkpoint: ``query``, ``caption``, ``point``, ``detect``, ``chat``,
    and ``segment`` where the model's family has it (``supports_segment``).

    ``model``: a checkpoint directory or a Hugging Face repo id (None: the embedded default).
    The options below are keywords, or one :class:`~kestrel.engine.options.EngineOptions`
    (``Engine(model, options)``, keywords given with it overriding its fields); ``options``
    holds them. ``device="auto"`` picks CUDA when available; ``dtype`` is a ``torch.dtype``
    or its name (None: bfloat16 on CUDA, float32 on CPU). ``max_adapters`` bounds the loaded
    LoRA adapters. Images are turned upright by their EXIF orientation unless
    ``exif_orientation=False`` (docs/images.md says what happens to each kind of image).
    With the prefix cache on, a finished request's generated tokens stay cached under its
    prompt, so the next turn of a conversation hits through the answer;
    ``retain_decoded=False`` frees them instead.
    ``moe_weights`` (Moondream 3): ``"fp8"`` keeps the experts float8_e4m3 with row scales in
    memory (quantising a 16-bit file's at load), ``"dequantize"`` widens FP8 experts to
    ``dtype``; None keeps what the file holds (docs/models.md). ``kv_dtype="fp8"`` stores the
    KV pages as float8_e4m3 with the checkpoint's per-layer ``kv_quantizer`` scales (refused
    when it has none; decode then runs the torch attention reference, without CUDA graphs).
    ``compile=True`` (opt-in, experimental) runs the decode step through ``torch.compile``, one
    graph per batch-size bucket compiled on first use (docs/kernels.md); refused with the
    reason where inductor cannot compile for the device.
    ``lookahead``: queue each decode step before the previous one's tokens are read (the device
    never waits on the host; docs/kernels.md); None (default) turns it on for CUDA only.
    ``embedding_cache_mb``: the budget of the image-embedding tier, which keeps each image's
    vision-encoder output past its KV so an image seen before is never encoded again (None:
    sized from the KV pool, see docs/prefix_cache.md; 0: off). ``host_kv_gb`` (CUDA only):
    pinned host memory that keeps the KV pages the prefix cache evicts, copied back when a
    later request matches through them (None or 0: off; refused on a CPU device, whose KV
    pool already is host memory). ``device_crops``: cut a lone new image's crops on the
    model's device from the uploaded image, libvips' bytes exactly (docs/kernels.md); None
    (default): on CUDA, if a start-up probe finds the same bytes; False: the host's crop
    workers make every image's crops. ``image_memory_mb``: the decoded image bytes the
    calls' decodes may hold at once (None: a sixteenth of the machine's memory, 256 MiB to
    1 GiB); past it a decode waits, and raises OverloadedError after 30 s (docs/images.md).
    Encoded images larger than their crops use are reduced as they are decoded.
    Every call takes ``adapter=name`` and ``cache_salt`` (a tenant's string: requests with
    different salts never share cache entries). Every method is thread-safe; ``a*`` twins
    serve asyncio callers. Use as a context manager, or call :meth:`close`.
    """

    @takes_options
    def __init__(
        self,
        model: str | Path | None = None,
        options: EngineOptions | None = None,
        **overrides: Any,
    ) -> None:
        o = self.options = EngineOptions.of(options, **overrides)
        for name, value in (("lookahead", o.lookahead), ("device_crops", o.device_crops)):
            if value is not None and not isinstance(value, bool):
                raise InvalidInputError(f"{name} must be True, False or None, got {value!r}")
        image_memory = budget_bytes(o.image_memory_mb)
        self.runtime, self.model_path = load_runtime(model, o)
        self.config = self.runtime.config
        self.max_batch_size = o.max_batch_size
        self.exif_orientation = o.exif_orientation
        self._factory = RequestFactory(
            ModelHeads(self.runtime.model, self.runtime.tokenizer), self.config
        )
        self._executor = BatchExecutor(self.runtime, lookahead=o.lookahead)
        self._scheduler = Scheduler(self._executor)
        self._adapters = AdapterRegistry(self.runtime.model, o.max_adapters)
        self._replies = ReplyMemory()
        self._loop = SchedulerLoop(self._scheduler)
        # encoded images seen before come back deferred: no decode unless their crops are needed
        self.image_fit, self.image_budget, self._images = intake(
            self.config.vision, o.exif_orientation, image_memory
        )
        self._drafts = Drafter(
            self._factory, self._adapters, self._replies, self._images.prepare, lambda: self.closed
        )
        self._requests = Submitter(self._loop, self.runtime.crops, self.runtime.embeddings)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Fail pending and running requests with EngineClosedError, then join the thread."""
        self._loop.close()
        self.runtime.crops.close()

    @property
    def closed(self) -> bool:
        return self._loop.closed

    # ------------------------------------------------------------------ images and adapters
    def prepare_image(self, image: object) -> PreparedImage:
        """Decode and hash once; pass the result as ``image`` to any call."""
        return prepare_image(image, exif_orientation=self.exif_orientation, fit=self.image_fit)

    def load_adapter(self, name: str, path: str | Path) -> str:
        """Load a LoRA adapter (``.safetensors``, reference ``final.pt``, or a folder of one)
        under ``name`` for ``adapter=name`` on any call; loading a name again replaces its
        weights (and its cache identity). Returns the cache identity ``name@<digest>``."""
        return self._adapters.load(name, path).lora_id

    def unload_adapter(self, name: str) -> None:
        """Forget ``name``: running requests that use it finish; new ones get
        UnknownAdapterError."""
        self._adapters.unload(name)

    def adapters(self) -> list[str]:
        """Names of the loaded adapters."""
        return self._adapters.names()

    def check_response_format(self, response_format: object) -> None:
        """Check ``response_format`` as a query would (its grammar compiled, and cached for
        the calls that use it); raises InvalidInputError naming what is wrong."""
        self._factory.answer_options(None, response_format, None)

    @property
    def supports_segment(self) -> bool:
        """Whether the model can run the segment skill (Moondream 3 can); where it cannot,
        ``segment`` raises UnsupportedError naming why."""
        return self._factory.segment_refusal is None

    @property
    def lookahead(self) -> bool:
        """Whether decode queues each step before reading the last one's tokens
        (``lookahead=None`` resolved: on for a CUDA model)."""
        return self._executor.lookahead

    @property
    def decode_steps(self) -> int:
        """Batched decode steps run since start (a benchmark's divisor: time per step)."""
        return self._scheduler.counters.decode_steps

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        """A consistent snapshot, taken on the scheduler thread between steps."""
        return self._on_scheduler(self._stats_now)

    def check_integrity(self) -> None:
        """Assert every cache / page-table / scheduler invariant (on the scheduler thread)."""
        self._on_scheduler(self._scheduler.check_integrity)

    def _stats_now(self) -> EngineStats:
        c = self.runtime.counters
        s = self._scheduler
        return EngineStats(
            requests_served=s.counters.served,
            requests_failed=s.counters.failed,
            requests_cancelled=s.counters.cancelled,
            running=len(s.running),
            queue_depth=len(s.waiting),
            hit_rate=c.hit_rate,
            prefill_tokens_saved=c.cached_tokens,
            vision_encodes_skipped=s.counters.vision_skipped,
            **self._executor.pages(),
            vision_encodes=c.encoder_runs,
            image_decodes_skipped=self._images.repeats,
            **self.image_budget.stats_fields(),
            **self.runtime.embeddings.stats_fields(),
            **self._host_kv_fields(),
        )

    def _host_kv_fields(self) -> dict[str, int]:
        host = self.runtime.prefix_cache.host
        if host is None:
            return {}
        host.poll()  # (scheduler thread) entries whose copies finished
        s = host.stats()
        return {"host_kv_hits": s.hits, "host_kv_bytes": s.bytes,
                "host_kv_budget_bytes": s.budget_bytes}  # fmt: skip

    def _on_scheduler(self, fn: Callable[[], Any]) -> Any:
        return self._loop.call(fn)
