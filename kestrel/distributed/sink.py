"""The output of a Ray batch job: a folder of JSONL (or Parquet) files written by Ray Data.

``--out`` names a folder (Ray Data's writers write one file per write task, named by the job's
write id, so a later run adds files and never touches earlier ones). A JSONL line is exactly
``kestrel batch``'s line plus ``"replica"``; a Parquet file has one column per field, null
where a field is absent. Resume: the ids in the folder's files are done and skipped; a partial
last line left by a killed job is cut off first (its request runs again); a Parquet file that
cannot be read is an error to fix by hand (delete it: its rows run again).

The sink also tallies what each write task wrote (:class:`~kestrel.distributed.summary.Tally`);
:meth:`OutputSink.on_write_complete` merges the tallies on the driver.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from ray.data.block import Block, BlockAccessor
from ray.data.datasource import BlockBasedFileDatasink, WriteResult

from kestrel.batch.output import completed_ids, open_for_append
from kestrel.errors import InvalidInputError

from .rows import record_of
from .summary import Tally

__all__ = ["OutputSink", "completed_in", "output_format"]


def output_format(out: str | Path) -> str:
    """``"parquet"`` when ``out`` ends with ``.parquet``, else ``"jsonl"``."""
    return "parquet" if str(out).lower().endswith(".parquet") else "jsonl"


def completed_in(out: str | Path) -> set[str]:
    """The ids already written to the output folder ``out`` (none if it does not exist)."""
    folder = Path(out).expanduser()
    if not folder.exists():
        return set()
    if not folder.is_dir():
        raise InvalidInputError(
            f"--out {out} is a file; with --ray it names a folder (Ray Data writes one file "
            "per write task there)"
        )
    done: set[str] = set()
    if output_format(out) == "parquet":
        for path in sorted(folder.glob("*.parquet")):
            try:
                ids = pq.read_table(path, columns=["id"]).column("id").to_pylist()
            except (OSError, pa.ArrowException) as exc:
                raise InvalidInputError(
                    f"cannot read {path} ({exc}); a job killed while writing leaves such a "
                    "file: delete it and run again (its rows run again)"
                ) from exc
            done.update(ids)
        return done
    for path in sorted(folder.glob("*.jsonl")):
        open_for_append(path).close()  # cut a partial last line: its request runs again
        done |= completed_ids(path)
    return done


class OutputSink(BlockBasedFileDatasink):
    """Ray Data's block-based file writer, with ``kestrel batch``'s lines (or Parquet)."""

    def __init__(self, path: str, fmt: str) -> None:
        super().__init__(path, file_format=fmt)
        self.fmt = fmt
        self.tally: Tally | None = None  # set on the driver when the write completes

    def write_block_to_file(self, block: BlockAccessor, file: Any) -> None:
        table = block.to_arrow()
        if self.fmt == "parquet":
            pq.write_table(table, file)
            return
        for row in table.to_pylist():
            file.write((json.dumps(record_of(row), ensure_ascii=False) + "\n").encode())

    def write(self, blocks: Iterable[Block], ctx: Any) -> Tally:
        blocks = list(blocks)
        super().write(blocks, ctx)
        tally = Tally()
        for block in blocks:
            for row in BlockAccessor.for_block(block).to_arrow().to_pylist():
                tally.add(record_of(row))
        return tally

    def on_write_complete(self, write_result: WriteResult) -> None:
        super().on_write_complete(write_result)
        tally = Tally()
        for part in write_result.write_returns:
            if part is not None:
                tally.merge(part)
        self.tally = tally
