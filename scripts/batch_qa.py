"""Batch image QA over the public API: every image in a folder x every question in a file.

    python scripts/batch_qa.py --model tests/fixtures/md2-tiny-a \\
        --images photos/ --questions questions.txt --out answers.jsonl

An example to read and adapt; ``kestrel batch`` is the full tool (resume, JSONL input, summary).
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

from kestrel import Engine, KestrelError

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=None, help="checkpoint dir or hub id")
parser.add_argument("--images", type=Path, required=True)
parser.add_argument("--questions", type=Path, required=True)
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--max-tokens", type=int, default=64)
args = parser.parse_args()

questions = [q.strip() for q in args.questions.read_text().splitlines() if q.strip()]
images = sorted(p for p in args.images.rglob("*") if p.suffix.lower() in {".jpg", ".jpeg", ".png"})

settings = {"max_tokens": args.max_tokens}

with Engine(args.model) as engine, args.out.open("w") as out:
    in_flight = {}  # Future -> (image, question); bounded so memory stays flat on big folders

    def write_finished() -> None:  # wait for at least one answer, write all finished ones
        done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
        for future in done:
            image, question = in_flight.pop(future)
            line = {"image": str(image), "question": question}
            try:
                result = future.result()
                line |= {"answer": result.answer, "metrics": result.metrics.to_dict()}
            except KestrelError as exc:
                line["error"] = str(exc)
            out.write(json.dumps(line) + "\n")

    for image in images:
        try:
            prepared = engine.prepare_image(image)  # decode + hash once for all questions
        except KestrelError as exc:
            print(f"skipping {image}: {exc}")
            continue
        for question in questions:  # one image's questions together: they share its KV prefix
            while len(in_flight) >= 64:
                write_finished()
            future = engine.submit_query(prepared, question, settings=settings)
            in_flight[future] = (image, question)
    while in_flight:
        write_finished()
    print(json.dumps(engine.stats().to_dict(), indent=1))
