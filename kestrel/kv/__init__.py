"""KV memory: the page pool (``pool.py``), the page table of batch rows over it
(``page_table.py``), the paged K/V tensors (``storage.py``) and the page-table invariants
(``integrity.py``). No model code; the prefix cache sits on top of it."""

from __future__ import annotations
