"""Batch image QA over the public API: every image in a folder x every question in a file.

    python scripts/batch_qa.py --model tests/fixtures/md2-tiny-a \\
        --images photos/ --questions questions.txt --out answers.jsonl
    python scripts/batch_qa.py --smoke      # the demo scenes x two questions, to a temp file

An example to read and adapt; ``kestrel batch`` is the full tool (resume, JSONL input, summary).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

from kestrel import Engine, KestrelError

SMOKE_QUESTIONS = "How many shapes are there?\nWhat color is the circle?\n"


def answer_all(engine: Engine, images: list[Path], questions: list[str], out, settings) -> None:
    """Every image x every question, at most 64 in flight; one JSON line per answer."""
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir or hub id")
    parser.add_argument("--images", type=Path)
    parser.add_argument("--questions", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--smoke", action="store_true",
                        help="the bundled demo scenes x two questions, 4 tokens")  # fmt: skip
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            from kestrel.tiny import DEMO_DIR

            args.images = args.images or DEMO_DIR
            if args.questions is None:
                args.questions = Path(tmp) / "questions.txt"
                args.questions.write_text(SMOKE_QUESTIONS)
            args.out = args.out or Path(tmp) / "answers.jsonl"
            args.max_tokens = 4
        if not (args.images and args.questions and args.out):
            parser.error("--images, --questions and --out are needed (or --smoke)")
        text = args.questions.read_text()
        questions = [q.strip() for q in text.splitlines() if q.strip()]
        suffixes = {".jpg", ".jpeg", ".png"}
        images = sorted(p for p in args.images.rglob("*") if p.suffix.lower() in suffixes)
        with Engine(args.model) as engine, args.out.open("w") as out:
            answer_all(engine, images, questions, out, {"max_tokens": args.max_tokens})
            print(json.dumps(engine.stats().to_dict(), indent=1))


if __name__ == "__main__":
    main()
