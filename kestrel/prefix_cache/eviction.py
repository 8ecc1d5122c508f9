"""LRU eviction over a lazy-deletion min-heap.

Entries are ``(last_access_time, counter, node, version)``. Nothing is ever removed from the
middle of the heap: when a node changes (locked, re-queued, detached, given a child) its old
entries simply go stale, and every popped entry is validated before it is trusted. A stale
entry that survived a re-lock once evicted pages a running prefill was reading in another
cache; here a candidate must pass every check below or it is dropped.

Access times are refreshed by matches without touching the heap: when a popped entry's time is
older than the node's current time, the node is re-queued at its new time instead of evicted.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .node import TreeNode

__all__ = ["LRUEvictionPolicy"]

_MIN_COMPACT = 64


class LRUEvictionPolicy:
    """Chooses which unlocked leaf to evict next (least recently used first).

    The cache calls :meth:`push` whenever a node becomes an unlocked, attached, non-root leaf
    (created, unlocked to zero, or its last child evicted). :meth:`pop` returns only nodes that
    are still exactly that.
    """

    __slots__ = ("_compact_at", "_counter", "_heap")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, TreeNode, int]] = []
        self._counter = 0
        self._compact_at = _MIN_COMPACT

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: TreeNode) -> None:
        """Queue ``node`` at its current access time; older entries for it become stale."""
        node.heap_version += 1
        self._counter += 1
        heapq.heappush(self._heap, (node.last_access_time, self._counter, node, node.heap_version))
        if len(self._heap) > self._compact_at:
            self._compact()

    def pop(self) -> TreeNode | None:
        """The least recently used valid candidate, or ``None`` when none is left."""
        heap = self._heap
        while heap:
            entry_time, _, node, version = heapq.heappop(heap)
            parent = node.parent
            if (  # is_candidate(node), inlined: this runs once per evicted node
                version != node.heap_version
                or parent is None
                or node.children
                or node.lock_ref
                or node.detached
                or parent.children.get(node.key) is not node
            ):
                continue
            if entry_time != node.last_access_time:
                # Matched since it was queued: move it to its new place in the order.
                self.push(node)
                continue
            return node
        return None

    def live_nodes(self) -> set[int]:
        """ids of nodes with a current (non-stale) entry; used by integrity checks."""
        return {id(n) for _, _, n, v in self._heap if v == n.heap_version}

    def clear(self) -> None:
        self._heap.clear()
        self._compact_at = _MIN_COMPACT

    def _compact(self) -> None:
        # Drop stale entries so the heap stays proportional to the live candidates; the
        # threshold doubles with the survivors, so the cost is amortised O(1) per push.
        self._heap = [e for e in self._heap if e[3] == e[2].heap_version and is_candidate(e[2])]
        heapq.heapify(self._heap)
        self._compact_at = max(_MIN_COMPACT, 2 * len(self._heap))


def is_candidate(node: TreeNode) -> bool:
    """True when ``node`` may be evicted now: an attached, unlocked, non-root leaf that its
    parent still holds under its first key."""
    parent = node.parent
    return (
        parent is not None
        and not node.children
        and node.lock_ref == 0
        and not node.detached
        and parent.children.get(node.key) is node
    )
