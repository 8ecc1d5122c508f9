"""The attention contract's explicit arguments as the kernels take them: the metadata entries
of a test's argument dict folded into one ``AttentionMeta``."""

from __future__ import annotations

from kestrel_kernels.plan import AttentionMeta

META = ("page_table", "seqused_k", "seqused_q", "bidir_regions", "causal")


def with_meta(args: dict) -> dict:
    """``args`` with its metadata entries (``META``) folded into ``meta=AttentionMeta(...)``."""
    rest = {k: v for k, v in args.items() if k not in META}
    return {**rest, "meta": AttentionMeta(**{k: args[k] for k in META if k in args})}
