"""Hub downloads of sharded checkpoints go by the index: the index first, then exactly the files
its ``weight_map`` names. Offline, against a fake ``huggingface_hub`` whose repo is a dict of
files and whose ``snapshot_download`` copies the allowed ones into a snapshot folder."""

from __future__ import annotations

import fnmatch
import functools
import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save

from kestrel.moondream.hub import _literal, index_shards
from kestrel.moondream.shards import ShardSet
from kestrel.moondream.weights import (
    CheckpointError,
    load_config,
    load_state_dict,
    resolve_checkpoint,
)
from tests.unit.test_weights import FakeHub

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MD3 = FIXTURES / "md3-tiny-a"
INDEX = "model.safetensors.index.json"
REPO = "moondream/moondream3-preview"
V1 = [f"model-{i:05d}-of-00002.safetensors" for i in (1, 2)]
V2 = [f"modelv2-{i:05d}-of-00004.safetensors" for i in (1, 2, 3, 4)]
# The preview's listing as published: two shard sets, one index, the FP8 pickle, remote code.
PREVIEW = [".gitattributes", "README.md", "config.json", "tokenizer.json", "hf_moondream.py",
           "moondream.py", INDEX, *V1, *V2, "model_fp8.pt"]  # fmt: skip


@functools.cache
def shard_bytes(names: tuple[str, ...]) -> tuple[dict[str, bytes], dict[str, str]]:
    """md3-tiny-a's tensors split over ``names`` (file -> bytes) and the weight_map."""
    tensors = load_file(str(MD3 / "model.safetensors"))
    keys = sorted(tensors)
    files, weight_map = {}, {}
    for i, name in enumerate(names):
        part = keys[i :: len(names)]
        files[name] = save({k: tensors[k] for k in part})
        weight_map.update(dict.fromkeys(part, name))
    return files, weight_map


class RepoHub(FakeHub):
    """A repo of real bytes: ``snapshot_download`` writes the files its patterns allow into the
    snapshot, and with ``fail_after`` raises after writing that many weight files (a download
    cut off midway)."""

    def __init__(self, repo: dict[str, bytes], snapshot: Path, fail_after: int | None = None):
        super().__init__(sorted(repo), snapshot)
        self.repo, self.fail_after, self.written = repo, fail_after, 0

    def snapshot_download(self, repo_id: str, **kwargs: object) -> str:
        self.downloads.append(kwargs)
        patterns = kwargs["allow_patterns"]
        if not kwargs.get("local_files_only"):
            self.snapshot.mkdir(parents=True, exist_ok=True)
            for name in sorted(self.repo):
                if any(fnmatch.fnmatch(name, p) for p in patterns):  # type: ignore[union-attr]
                    if name.endswith(".safetensors"):
                        if self.written == self.fail_after:
                            raise ConnectionError("connection reset")
                        self.written += 1
                    (self.snapshot / name).write_bytes(self.repo[name])
        return str(self.snapshot)


def preview_repo(indexed: list[str]) -> dict[str, bytes]:
    """The preview's listing; both shard sets hold md3-tiny-a, the index names ``indexed``."""
    repo = {name: b"" for name in PREVIEW}
    for names in (V1, V2):
        files, weight_map = shard_bytes(tuple(names))
        repo.update(files)
        if names == indexed:
            repo[INDEX] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    for name in ("config.json", "tokenizer.json"):
        repo[name] = (MD3 / name).read_bytes()
    return repo


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return monkeypatch


@pytest.mark.parametrize("indexed", [V1, V2], ids=["index-names-model", "index-names-modelv2"])
def test_the_index_chooses_the_shard_set(indexed, online, tmp_path: Path) -> None:
    """The index first, then exactly its shards and the companions; the other set and the FP8
    pickle are never fetched, and the snapshot loads as md3-tiny-a."""
    hub = RepoHub(preview_repo(indexed), tmp_path / "snap")
    online.setitem(sys.modules, "huggingface_hub", hub)
    got = resolve_checkpoint(REPO, revision="main")
    assert got == tmp_path / "snap" and hub.listed == ["main"]
    assert [d["allow_patterns"] for d in hub.downloads] == [
        [INDEX],
        [INDEX, *indexed, "config.json", "tokenizer.json"],
    ]
    assert sorted(p.name for p in got.iterdir()) == sorted(
        [INDEX, *indexed, "config.json", "tokenizer.json"]
    )
    assert [f.name for f in ShardSet.locate(got).files] == indexed
    config = load_config(got)
    want = load_state_dict(MD3, config)
    sd = load_state_dict(got, config)
    assert sd.keys() == want.keys()
    assert all(sd[k].equal(want[k]) for k in want)  # the same bytes, re-sharded


def test_shard_names_with_wildcards_are_fetched_literally() -> None:
    """An allow-pattern per shard matches that shard and nothing else."""
    names = ["model[1].safetensors", "model1.safetensors", "a*1.safetensors", "ab1.safetensors",
             "a?.safetensors", "ab.safetensors", V2[0]]  # fmt: skip
    for name in names:
        assert fnmatch.filter(names, _literal(name)) == [name]


def test_an_index_naming_a_file_the_repo_lacks_downloads_nothing_more(online, tmp_path) -> None:
    repo = preview_repo(V2)
    del repo[V2[3]]
    hub = RepoHub(repo, tmp_path / "snap")
    online.setitem(sys.modules, "huggingface_hub", hub)
    with pytest.raises(CheckpointError, match=rf"names the shard '{V2[3]}', which the repo does"):
        resolve_checkpoint(REPO)
    assert len(hub.downloads) == 1 and hub.written == 0  # the index alone


@pytest.mark.parametrize(
    "name", ["../x.safetensors", "/etc/x.safetensors", "sub/x.safetensors", "..", "C:x", "a\\b"]
)
def test_an_index_naming_a_path_outside_the_snapshot_is_refused(name, online, tmp_path) -> None:
    repo = preview_repo(V2)
    weight_map = json.loads(repo[INDEX])["weight_map"]
    weight_map[next(iter(weight_map))] = name
    repo[INDEX] = json.dumps({"weight_map": weight_map}).encode()
    repo[name] = b"hostile"  # even if the listing claimed to hold it
    hub = RepoHub(repo, tmp_path / "snap")
    online.setitem(sys.modules, "huggingface_hub", hub)
    with pytest.raises(CheckpointError, match="not a file name beside the index"):
        resolve_checkpoint(REPO)
    assert len(hub.downloads) == 1 and hub.written == 0
    assert not (tmp_path / "x.safetensors").exists()


def test_a_download_cut_off_midway_is_not_loaded(online, tmp_path: Path) -> None:
    """The first shard arrives, the second fails: an error, and the snapshot left behind (two
    of four shards) is refused by the loader too."""
    hub = RepoHub(preview_repo(V2), tmp_path / "snap", fail_after=2)
    online.setitem(sys.modules, "huggingface_hub", hub)
    with pytest.raises(CheckpointError, match="ConnectionError: connection reset"):
        resolve_checkpoint(REPO)
    snap = tmp_path / "snap"
    assert sorted(p.name for p in snap.glob("*.safetensors")) == V2[:2]
    with pytest.raises(CheckpointError, match="not a file next to it"):
        load_state_dict(snap, load_config(MD3))


def test_offline_a_cache_missing_the_indexed_shards_fails_clearly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An earlier download fetched the model-* set; the index now in the cache names modelv2-*
    (or the cached shards are incomplete): offline this says what is missing, loads nothing."""
    snap = tmp_path / "snap"
    snap.mkdir()
    repo = preview_repo(V2)
    for name in [INDEX, *V2[:3], "config.json", "tokenizer.json"]:
        (snap / name).write_bytes(repo[name])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = RepoHub(repo, snap)
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    with pytest.raises(CheckpointError, match=r"local hub cache .* lacks 1 shard\(s\)") as err:
        resolve_checkpoint(REPO)
    assert V2[3] in str(err.value) and "go online" in str(err.value)
    assert hub.listed == [] and hub.downloads[0]["local_files_only"] is True
    (snap / V2[3]).write_bytes(repo[V2[3]])  # the cache complete: it loads offline
    assert resolve_checkpoint(REPO) == snap


def test_index_shards_reads_and_checks_the_names(tmp_path: Path) -> None:
    index = tmp_path / INDEX
    index.write_text(json.dumps({"weight_map": {"a": V2[1], "b": V2[0], "c": V2[1]}}))
    assert index_shards(index) == (V2[0], V2[1])
    assert index_shards(index, V2) == (V2[0], V2[1])
    with pytest.raises(CheckpointError, match="which the repo does not have"):
        index_shards(index, V1)
    for bad in ("{}", '{"weight_map": {}}', '{"weight_map": []}', "not json"):
        index.write_text(bad)
        with pytest.raises(CheckpointError, match="cannot read the shard index"):
            index_shards(index)
    index.write_text(json.dumps({"weight_map": {"a": 3}}))
    with pytest.raises(CheckpointError, match="not a file name"):
        index_shards(index)


def test_a_stale_index_does_not_block_the_fp8_file(online, tmp_path: Path) -> None:
    """FP8 asked for: model_fp8.pt is fetched and returned; an index left in the snapshot by an
    earlier, unfinished sharded download is not what loads, so it is not checked."""
    repo = preview_repo(V2)
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / INDEX).write_bytes(repo[INDEX])  # its shards never arrived
    hub = RepoHub(repo, snap)
    online.setitem(sys.modules, "huggingface_hub", hub)
    assert resolve_checkpoint(REPO, prefer_fp8=True) == snap / "model_fp8.pt"
    assert [d["allow_patterns"] for d in hub.downloads] == [
        ["model_fp8.pt", "config.json", "tokenizer.json"]
    ]
    (snap / "model_fp8.pt").unlink()  # offline without the FP8 file: the index would load
    online.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match=r"the local hub cache .* lacks 4 shard\(s\)"):
        resolve_checkpoint(REPO, prefer_fp8=True)
