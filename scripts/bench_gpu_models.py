"""The random-weight models ``bench_gpu.py`` serves: Moondream 2 from a checkpoint written once,
Moondream 3 made on the device.

Moondream 2 (1.9 B parameters) is written once to a folder as a bf16 checkpoint and loaded
through the normal loader. Moondream 3 of the published dimensions (9.3 B parameters: 24
layers of 2048, 64 experts of 1024, top 8, from layer 4; the experts FP8 as published) would be
a ~10 GB checkpoint to write and read back, longer than the GPU check's whole budget, so only
its ``config.json`` and tokenizer are written, and while ``md3_on_device`` is active the
Engine loads that folder through ``kestrel.engine.setup.model_loader``'s hook, which makes its
weights on the device instead of reading them (``random_weights.random_model``, each expert
stack quantised as it is drawn). Everything after the weights -- the runtime, its graphs,
the scheduler -- is the Engine's own. Both tokenizers are the fixtures', widened with
placeholder ids to the vocabulary, so every id a random model samples decodes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FIXTURES = {"md2": REPO / "tests" / "fixtures" / "md2-tiny-a",
            "md3": REPO / "tests" / "fixtures" / "md3-tiny-a"}  # fmt: skip


def widened_tokenizer(src: Path, dst: Path, vocab_size: int) -> None:
    """``src``'s tokenizer with placeholder entries up to ``vocab_size`` ids, so every id a
    random-weight model samples decodes (to ``<tN>``)."""
    data = json.loads(src.read_text())
    vocab = data["model"]["vocab"]
    vocab.update({f"<t{i}>": i for i in range(max(vocab.values()) + 1, vocab_size)})
    dst.write_text(json.dumps(data))


def _byte_chars() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table)."""
    shown = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out = {b: chr(b) for b in shown}
    for n, b in enumerate(b for b in range(256) if b not in out):
        out[b] = chr(256 + n)
    return out


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair whose merge makes ``token``: BPE run on its bytes with the lower ranks."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        i = min(range(len(parts) - 1), key=lambda j: ranks.get(parts[j] + parts[j + 1], 1 << 30))
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def gpt2_tokenizer(ranks_file: Path, dst: Path, vocab_size: int) -> None:
    """A real 50,256-token byte-level BPE vocabulary in the fixture's layout (its 10 special
    ids first, then GPT-2's tokens from id 10, as Moondream 2's own tokenizer is built), padded
    with placeholders to ``vocab_size``. ``ranks_file``: GPT-2's ranks in tiktoken's format
    (base64 token, rank per line), e.g. ``whisper/assets/gpt2.tiktoken`` from the
    ``openai-whisper`` source package (``pip download openai-whisper --no-deps --no-binary
    :all:``)."""
    import base64

    ranks = {}
    for line in ranks_file.read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    chars = _byte_chars()
    shown = {t: "".join(chars[b] for b in t) for t in ranks}
    data = json.loads((FIXTURES["md2"] / "tokenizer.json").read_text())
    specials = {a["content"]: a["id"] for a in data["added_tokens"]}
    base = max(specials.values()) + 1
    vocab = {**specials, **{shown[t]: base + r for t, r in ranks.items()}}
    order = sorted((t for t in ranks if len(t) > 1), key=ranks.__getitem__)
    merges = [[shown[a], shown[b]] for a, b in (_last_merge(t, ranks) for t in order)]
    data["model"]["vocab"], data["model"]["merges"] = vocab, merges
    dst.write_text(json.dumps(data))
    widened_tokenizer(dst, dst, vocab_size)


def _config(family: str, sections: dict | None):
    """The family's production dimensions (or ``sections`` over them), the fixture's
    tokenizer section."""
    from kestrel.moondream.config import MOONDREAM2, MOONDREAM3, MoondreamConfig
    from kestrel.testing.random_checkpoint import config_to_dict

    fixture = MoondreamConfig.from_json_file(FIXTURES[family] / "config.json")
    data = {**(sections or {}), "tokenizer": config_to_dict(fixture)["tokenizer"]}
    return MoondreamConfig.from_dict(data, family=MOONDREAM3 if family == "md3" else MOONDREAM2)


def random_md2_checkpoint(path: Path, sections: dict | None = None) -> Path:
    """A random-weight checkpoint at ``path`` (bf16), written if missing: Moondream 2's
    dimensions, or ``sections`` over them (the tests' small model); the fixture's tokenizer,
    widened to the vocabulary."""
    if (path / "config.json").exists():
        return path
    from kestrel.testing.random_checkpoint import write_random_checkpoint

    cfg = _config("md2", sections)
    print(f"writing a random-weight checkpoint to {path} (once)", flush=True)
    write_random_checkpoint(path, cfg, dtype=torch.bfloat16)
    widened_tokenizer(FIXTURES["md2"] / "tokenizer.json", path / "tokenizer.json",
                      cfg.text.vocab_size)  # fmt: skip
    return path


def md3_folder(path: Path, sections: dict | None = None) -> Path:
    """``config.json`` and the widened tokenizer of a random Moondream 3 at ``path`` (no
    weights: ``md3_on_device`` makes them); the published dimensions, or ``sections`` over
    them."""
    from kestrel.testing.random_checkpoint import config_to_dict

    cfg = _config("md3", sections)
    path.mkdir(parents=True, exist_ok=True)
    data = {"model_type": "moondream3", "config": config_to_dict(cfg)}
    (path / "config.json").write_text(json.dumps(data))
    widened_tokenizer(FIXTURES["md3"] / "tokenizer.json", path / "tokenizer.json",
                      cfg.text.vocab_size)  # fmt: skip
    return path


@contextlib.contextmanager
def md3_on_device(folder: Path, seed: int = 0) -> Iterator[None]:
    """While active, the Engine's loader makes ``folder``'s weights on the device (random,
    FP8 experts) instead of reading a checkpoint; any other source loads as usual."""
    from kestrel.engine.setup import load_model, model_loader
    from kestrel.moondream.config import MoondreamConfig
    from kestrel.moondream.tokenizer import MoondreamTokenizer
    from kestrel.testing.random_weights import random_model

    def load(source, device, dtype, moe_weights, kv_dtype):
        if Path(source).resolve() != folder.resolve():
            return load_model(source, device, dtype, moe_weights, kv_dtype)
        cfg = MoondreamConfig.from_json_file(folder / "config.json")
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        model = random_model(cfg, device=device, dtype=dtype, seed=seed, fp8_experts=True)
        return model, MoondreamTokenizer.for_checkpoint(folder), None

    with model_loader(load):
        yield
