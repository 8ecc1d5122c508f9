"""The GPU bench's workload, shaped like ChartQA: generated charts as PNG bytes and questions
of a set token length, about 1.66 per chart (``scripts/bench_gpu.py`` has the whole story;
``bench_images.py`` decodes the same charts)."""

from __future__ import annotations

import io
import itertools
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "QUESTIONS_PER_IMAGE",
    "SUBJECTS",
    "TEMPLATES",
    "Query",
    "chart_png",
    "chart_workload",
    "question",
]

QUESTIONS_PER_IMAGE = 1.66
QUESTION_TOKENS = (12, 20)
SUBJECTS = ["revenue", "sales", "the population", "exports", "the share of voters",
            "profit", "the number of visitors", "spending", "the unemployment rate",
            "production"]  # fmt: skip
LABELS = ["2015", "2016", "2017", "2018", "2019", "2020", "2021", "Asia", "Europe", "Africa",
          "Q1", "Q2", "Q3", "Q4", "Men", "Women", "Online", "Retail"]  # fmt: skip
TEMPLATES = [
    "What was the value of {s} in {a} according to the chart shown here?",
    "What is the difference between {s} in {a} and in {b} in this chart?",
    "Which category has the highest value of {s} in the chart, {a} or {b}?",
    "By how much did {s} change from {a} to {b} according to the graph?",
    "Is the value of {s} in {a} greater than the average over all the years?",
    "What is the sum of {s} in {a} and {b}, as shown in the bar chart?",
]


@dataclass(frozen=True, slots=True)
class Query:
    image: bytes  # an encoded PNG, as a client sends it
    question: str


def chart_png(rng: np.random.Generator) -> bytes:
    """A bar or line chart with a title, axes, gridlines, tick labels and a legend."""
    w, h = int(rng.integers(640, 901)), int(rng.integers(480, 641))
    img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(235, 256, 3)))
    d = ImageDraw.Draw(img)
    left, top, right, bottom = 70, 60, w - 30, h - 60
    d.text((w // 3, 20), f"{rng.choice(SUBJECTS).title()} by year", fill=(20, 20, 20))
    for k in range(6):  # gridlines and y tick labels
        y = bottom - k * (bottom - top) // 5
        d.line([(left, y), (right, y)], fill=(210, 210, 210))
        d.text((20, y - 6), str(k * int(rng.integers(5, 50))), fill=(60, 60, 60))
    d.line([(left, top), (left, bottom), (right, bottom)], fill=(0, 0, 0), width=2)
    n = int(rng.integers(4, 9))
    values = rng.uniform(0.1, 1.0, n)
    step = (right - left) / n
    colour = tuple(int(v) for v in rng.integers(30, 200, 3))
    points = []
    for i, v in enumerate(values):
        x0, y = left + i * step, bottom - v * (bottom - top)
        if rng.random() < 0.6:  # a bar chart, mostly
            d.rectangle([x0 + step * 0.15, y, x0 + step * 0.85, bottom], fill=colour)
        points.append((x0 + step / 2, y))
        d.text((x0 + step * 0.3, bottom + 8), LABELS[i % len(LABELS)], fill=(40, 40, 40))
    if len(points) > 1:
        d.line(points, fill=(200, 40, 40), width=3)
    d.rectangle([right - 120, top, right - 100, top + 12], fill=colour)
    d.text((right - 95, top), "series A", fill=(30, 30, 30))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def question(rng: np.random.Generator, n_tokens, bounds=QUESTION_TOKENS) -> str:
    """A chart question of ``bounds`` tokens (``n_tokens(text)``): a template, trimmed or
    extended a word at a time."""
    a, b = rng.choice(LABELS, 2, replace=False)
    words = str(rng.choice(TEMPLATES)).format(s=rng.choice(SUBJECTS), a=a, b=b).split()
    lo, hi = bounds
    while n_tokens(" ".join(words)) > hi and len(words) > 3:
        del words[len(words) // 2]  # drop a middle word, keep the ends
    pad = iter(itertools.cycle(["please", "answer", "briefly", "now"]))
    while n_tokens(" ".join(words)) < lo:
        words.insert(-1, next(pad))
    return " ".join(words)


def chart_workload(n: int, n_tokens, seed: int) -> list[Query]:
    """``n`` queries about ``round(n / 1.66)`` new charts, each chart's questions in a row."""
    rng = np.random.default_rng(seed)
    n_images = max(1, min(n, round(n / QUESTIONS_PER_IMAGE)))
    per_image = np.ones(n_images, dtype=int)
    np.add.at(per_image, rng.integers(0, n_images, n - n_images), 1)
    out = []
    for count in per_image:
        png = chart_png(rng)
        out += [Query(png, question(rng, n_tokens)) for _ in range(int(count))]
    return out
