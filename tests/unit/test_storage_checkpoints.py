"""Checkpoints: folder upload with manifest, digest-keyed cache, resolution, lineage."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pytest

from storage import (
    ROLLOUT,
    AlreadyCommittedError,
    ChecksumMismatchError,
    NotCommittedError,
    RunLayout,
    ShardWriter,
    StageOutput,
    checkpoint_exists,
    commit_iteration,
    create_or_open_run,
    download_checkpoint,
    format_lineage,
    lineage,
    resolve_checkpoint,
    upload_checkpoint,
)
from storage.hashing import sha256_local_file
from storage.objects import ObjectStore
from storage.synthetic import synthetic_columns


@pytest.fixture(params=["memory", "file"])
def layout(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunLayout]:
    root = str(tmp_path / "runs") if request.param == "file" else f"memory://test-{uuid.uuid4().hex}"
    layout = RunLayout(root, "run")
    create_or_open_run(layout, {"lr": 1e-6})
    yield layout
    memory = fsspec.filesystem("memory")
    if request.param == "memory" and memory.exists(root):
        memory.rm(root, recursive=True)


def _megatron_like(folder: Path, seed: int = 0) -> Path:
    """A folder with sub-directories, like a Megatron distributed checkpoint plus an HF export."""
    rng = np.random.default_rng(seed)
    (folder / "model" / "__0_0.distcp").parent.mkdir(parents=True)
    (folder / "model" / "__0_0.distcp").write_bytes(rng.bytes(5000))
    (folder / "model" / ".metadata").write_bytes(rng.bytes(300))
    (folder / "hf").mkdir()
    (folder / "hf" / "model.safetensors").write_bytes(rng.bytes(4000))
    (folder / "hf" / "config.json").write_text('{"model_type": "qwen3"}')
    return folder


def _teacher_stage(layout: RunLayout, n: int):  # type: ignore[no-untyped-def]
    output = StageOutput(layout, n, "teacher")
    output.write_json("scores.json", {"n": n})
    return output.commit()


def test_upload_records_every_file_and_download_reproduces_the_folder(layout: RunLayout, tmp_path: Path) -> None:
    source = _megatron_like(tmp_path / "ckpt")
    teacher = _teacher_stage(layout, 0)
    manifest = upload_checkpoint(source, layout, 0, "policy", parent="Qwen/Qwen3-0.6B", trained_on=[teacher])
    names = sorted(e["name"] for e in manifest.data["files"])
    assert names == ["hf/config.json", "hf/model.safetensors", "model/.metadata", "model/__0_0.distcp"]
    for entry in manifest.data["files"]:
        assert entry["sha256"] == sha256_local_file(source / entry["name"])
    assert manifest.data["parent"] == {"external": "Qwen/Qwen3-0.6B"}
    assert manifest.data["trained_on"] == [teacher.ref]
    local = download_checkpoint(layout, 0, "policy", cache_dir=tmp_path / "cache")
    assert local == tmp_path / "cache" / manifest.sha256
    for name in names:
        assert (local / name).read_bytes() == (source / name).read_bytes()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no temp folders left


def test_cached_checkpoint_is_reused_without_downloading(
    layout: RunLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    upload_checkpoint(_megatron_like(tmp_path / "ckpt"), layout, 0, "policy", parent=None)
    first = download_checkpoint(layout, 0, "policy", cache_dir=tmp_path / "cache")

    def no_download(*args: object) -> None:
        raise AssertionError("downloaded although cached")

    monkeypatch.setattr(ObjectStore, "get_to_local", no_download)
    assert download_checkpoint(layout, "iter-0", "policy", cache_dir=tmp_path / "cache") == first


def test_an_adopted_upload_folder_is_the_cached_copy_and_still_checked(
    layout: RunLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from storage.cache import adopt_into_cache

    source = _megatron_like(tmp_path / "scratch" / "ckpt")
    expected = {p.relative_to(source).as_posix(): p.read_bytes() for p in source.rglob("*") if p.is_file()}
    manifest = upload_checkpoint(source, layout, 0, "policy", parent=None)
    adopted = adopt_into_cache(source, manifest, cache_dir=tmp_path / "cache")
    assert adopted == tmp_path / "cache" / manifest.sha256 and not source.exists()  # moved, not copied

    def no_download(*args: object) -> None:
        raise AssertionError("downloaded although adopted")

    with monkeypatch.context() as patched:
        patched.setattr(ObjectStore, "get_to_local", no_download)
        assert download_checkpoint(layout, 0, "policy", cache_dir=tmp_path / "cache") == adopted
    assert {n: (adopted / n).read_bytes() for n in expected} == expected
    # the adopted copy is checked like any cached one: a damaged byte is noticed and downloaded again
    damaged = bytearray((adopted / "hf" / "model.safetensors").read_bytes())
    damaged[0] ^= 0xFF
    (adopted / "hf" / "model.safetensors").write_bytes(bytes(damaged))
    again = download_checkpoint(layout, 0, "policy", cache_dir=tmp_path / "cache")
    assert (again / "hf" / "model.safetensors").read_bytes() == expected["hf/model.safetensors"]


def test_a_process_hashes_a_cached_file_once_until_the_file_changes(
    layout: RunLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from storage import cache
    from storage.cache import adopt_into_cache, forget_hashes

    hashed: list[str] = []

    def counting(path: object) -> str:
        hashed.append(str(path))
        return sha256_local_file(path)  # type: ignore[arg-type]

    monkeypatch.setattr(cache, "sha256_local_file", counting)
    forget_hashes()
    source = _megatron_like(tmp_path / "ckpt")
    manifest = upload_checkpoint(source, layout, 0, "policy", parent=None)
    local = download_checkpoint(layout, 0, "policy", cache_dir=tmp_path / "cache")
    hashed.clear()
    for _ in range(3):  # verified as it arrived: reused without reading a byte
        assert download_checkpoint(layout, 0, "policy", cache_dir=tmp_path / "cache") == local
    assert hashed == []
    # an upload moved into the cache was hashed as it was uploaded
    second = upload_checkpoint(_megatron_like(tmp_path / "scratch" / "ckpt", seed=1), layout, 1, "policy", parent=None)
    adopt_into_cache(tmp_path / "scratch" / "ckpt", second, cache_dir=tmp_path / "cache")
    download_checkpoint(layout, 1, "policy", cache_dir=tmp_path / "cache")
    assert hashed == []
    # a write changes the file's modification time: hashed again, found damaged, downloaded again
    weights = local / "hf" / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(bytes([original[0] ^ 0xFF]) + original[1:])
    again = download_checkpoint(layout, 0, "policy", cache_dir=tmp_path / "cache")
    assert str(weights) in hashed and (again / "hf" / "model.safetensors").read_bytes() == original
    # a file damaged behind the process's back with its identity restored (same inode, size and
    # modification time) is what this process trusts; a new process reads every file once
    stat = weights.stat()
    with open(weights, "r+b") as f:
        f.write(bytes([original[0] ^ 0xFF]))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    forget_hashes()
    fresh = download_checkpoint(layout, 0, "policy", cache_dir=tmp_path / "cache")
    assert (fresh / "hf" / "model.safetensors").read_bytes() == original
    assert manifest.sha256 == fresh.name


def test_adopting_keeps_the_cache_within_its_bound(layout: RunLayout, tmp_path: Path) -> None:
    """The train stage adopts two checkpoints an iteration: without the bound a long run (or runs
    side by side sharing a cache) fills the disk however small `storage.cache_max_gb` is."""
    import os

    from storage.cache import adopt_into_cache

    cache = tmp_path / "cache"
    adopted = []
    for n in range(4):
        source = _megatron_like(tmp_path / "scratch" / f"ckpt-{n}")
        (source / "hf" / "model.safetensors").write_bytes(bytes([n]) * 4096)  # a distinct digest each
        manifest = upload_checkpoint(source, layout, n, "policy", parent=None)
        one = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
        adopted.append(adopt_into_cache(source, manifest, cache_dir=cache, max_cache_bytes=2 * one))
        os.utime(adopted[-1], (1000 + n, 1000 + n))  # adoption order, whatever the clock's resolution
    assert sorted(p for p in cache.iterdir() if len(p.name) == 64) == sorted(adopted[2:])


def test_a_folder_that_is_not_the_upload_is_not_adopted(layout: RunLayout, tmp_path: Path) -> None:
    from storage.cache import adopt_into_cache

    source = _megatron_like(tmp_path / "ckpt")
    manifest = upload_checkpoint(source, layout, 0, "policy", parent=None)
    (source / "extra.txt").write_text("not uploaded")
    with pytest.raises(ValueError, match=r"is not the upload of .*extra \['extra.txt'\]"):
        adopt_into_cache(source, manifest, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("size", [0, 3 * 2**20 + 17, 8 * 2**20, 2 * 8 * 2**20 + 5])  # one chunk is 8 MiB
def test_uploads_and_downloads_return_the_digest_of_the_bytes_they_moved(
    layout: RunLayout, tmp_path: Path, size: int
) -> None:
    local = tmp_path / "blob.bin"
    local.write_bytes(np.random.default_rng(size).bytes(size))
    url = layout.url("blobs/blob.bin")
    assert layout.store.put_local_file(local, url) == sha256_local_file(local)
    copied = layout.store.get_to_local(url, tmp_path / "back.bin")
    assert copied in (None, sha256_local_file(local))  # file:// hashes on the way; memory:// does not
    assert (tmp_path / "back.bin").read_bytes() == local.read_bytes()


def test_damaged_cache_is_downloaded_again(layout: RunLayout, tmp_path: Path) -> None:
    source = _megatron_like(tmp_path / "ckpt")
    upload_checkpoint(source, layout, 0, "policy", parent=None)
    local = download_checkpoint(layout, 0, "policy", cache_dir=tmp_path / "cache")
    damaged = bytearray((local / "hf" / "model.safetensors").read_bytes())
    damaged[10] ^= 0xFF
    (local / "hf" / "model.safetensors").write_bytes(bytes(damaged))
    again = download_checkpoint(layout, 0, "policy", cache_dir=tmp_path / "cache")
    assert (again / "hf" / "model.safetensors").read_bytes() == (source / "hf" / "model.safetensors").read_bytes()


def test_flipped_byte_in_store_is_detected_on_download(layout: RunLayout, tmp_path: Path) -> None:
    manifest = upload_checkpoint(_megatron_like(tmp_path / "ckpt"), layout, 0, "policy", parent=None)
    entry = next(e for e in manifest.data["files"] if e["name"] == "model/__0_0.distcp")
    url = layout.url(entry["path"])
    data = bytearray(layout.store.read_bytes(url))
    data[123] ^= 0x01
    layout.store.write_bytes(url, bytes(data))
    with pytest.raises(ChecksumMismatchError) as info:
        download_checkpoint(layout, 0, "policy", cache_dir=tmp_path / "cache")
    assert url in str(info.value) and entry["sha256"] in str(info.value)
    cache = tmp_path / "cache"
    assert [p.name for p in cache.iterdir()] == ["pins"]  # nothing half-downloaded stays, no pin either
    assert list((cache / "pins").iterdir()) == []


def test_committed_checkpoint_is_never_overwritten_partial_upload_is_redone(layout: RunLayout, tmp_path: Path) -> None:
    source = _megatron_like(tmp_path / "ckpt")
    stray = layout.url("checkpoints/iter-0/policy/files/stale.bin")
    layout.store.write_bytes(stray, b"from an interrupted upload")
    manifest = upload_checkpoint(source, layout, 0, "policy", parent=None)
    assert not layout.store.exists(stray) and len(manifest.data["files"]) == 4
    with pytest.raises(AlreadyCommittedError):
        upload_checkpoint(source, layout, 0, "policy", parent=None)


def test_resolve_latest_follows_committed_iterations(layout: RunLayout, tmp_path: Path) -> None:
    with pytest.raises(NotCommittedError, match="no committed iteration"):
        resolve_checkpoint(layout, "latest")
    for n in range(2):
        output = StageOutput(layout, n, "rollout")
        with ShardWriter(output, ROLLOUT, top_k=2) as writer:
            writer.write(synthetic_columns(iteration=n, n_rows=2, top_k=2, rng=np.random.default_rng(n), vocab=50))
        rollout = output.commit()
        teacher = _teacher_stage(layout, n)
        train = StageOutput(layout, n, "train")
        train.write_json("m.json", {})
        train.commit()
        parent = "base" if n == 0 else resolve_checkpoint(layout, n - 1)
        upload_checkpoint(
            _megatron_like(tmp_path / f"c{n}", seed=n),
            layout,
            n,
            "policy",
            parent=parent,
            trained_on=[rollout, teacher],
        )
        commit_iteration(layout, n, metrics={})
    assert resolve_checkpoint(layout, "latest").data["iteration"] == 1
    assert resolve_checkpoint(layout, "iter-0").data["iteration"] == 0
    with pytest.raises(ValueError, match="not an iteration name"):
        resolve_checkpoint(layout, "best")
    with pytest.raises(NotCommittedError):
        resolve_checkpoint(layout, 0, "teacher")


def test_lineage_follows_parents_and_training_data(layout: RunLayout, tmp_path: Path) -> None:
    t0, t1 = _teacher_stage(layout, 0), _teacher_stage(layout, 1)
    p0 = upload_checkpoint(
        _megatron_like(tmp_path / "a"), layout, 0, "policy", parent="Qwen/Qwen3-0.6B", trained_on=[t0]
    )
    upload_checkpoint(_megatron_like(tmp_path / "b", seed=1), layout, 0, "teacher", parent=p0)
    p1 = upload_checkpoint(_megatron_like(tmp_path / "c", seed=2), layout, 1, "policy", parent=p0, trained_on=[t1])
    records = lineage(layout)
    assert [(r.iteration, r.kind) for r in records] == [(0, "policy"), (0, "teacher"), (1, "policy")]
    assert records[0].parent == "Qwen/Qwen3-0.6B" and records[0].parent_ok is None
    assert records[0].trained_on == (f"iter-0/teacher@{t0.sha256[:12]}",)
    assert records[2].parent == f"iter-0/policy@{p0.sha256[:12]}" and records[2].parent_ok is True
    assert records[2].sha256 == p1.sha256 and not records[2].committed
    text = format_lineage(records, title="run run")
    lines = text.splitlines()
    assert lines[0] == "run run" and lines[1].split()[:3] == ["iter", "kind", "checkpoint"]
    assert p1.sha256[:12] in lines[4] and f"iter-0/policy@{p0.sha256[:12]}" in lines[4] and "yes" in lines[4]


def test_lineage_flags_a_parent_whose_manifest_changed(layout: RunLayout, tmp_path: Path) -> None:
    p0 = upload_checkpoint(_megatron_like(tmp_path / "a"), layout, 0, "policy", parent=None)
    upload_checkpoint(_megatron_like(tmp_path / "b", seed=1), layout, 1, "policy", parent=p0)
    layout.store.write_bytes(
        layout.checkpoint_manifest(0, "policy"), layout.store.read_bytes(layout.checkpoint_manifest(0, "policy")) + b" "
    )
    assert lineage(layout)[1].parent_ok is False
    assert "NO" in format_lineage(lineage(layout)).splitlines()[2]


def test_megatron_checkpoints_are_a_kind_and_refs_resolve(layout: RunLayout, tmp_path: Path) -> None:
    assert not checkpoint_exists(layout, "iter-1", "megatron")
    upload_checkpoint(_megatron_like(tmp_path / "m"), layout, 1, "megatron", parent=None)
    assert checkpoint_exists(layout, "iter-1", "megatron") and checkpoint_exists(layout, 1, "megatron")
    assert not checkpoint_exists(layout, 1, "policy")
    with pytest.raises(ValueError, match="unknown checkpoint kind 'optimizer'"):
        checkpoint_exists(layout, 1, "optimizer")


def test_empty_or_missing_folder_is_refused(layout: RunLayout, tmp_path: Path) -> None:
    with pytest.raises(NotADirectoryError):
        upload_checkpoint(tmp_path / "nope", layout, 0, "policy", parent=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        upload_checkpoint(tmp_path / "empty", layout, 0, "policy", parent=None)


def test_part_of_a_checkpoint_downloads_only_the_files_chosen(
    layout: RunLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from storage.cache import download_checkpoint_files

    source = _megatron_like(tmp_path / "ckpt")
    manifest = upload_checkpoint(source, layout, 0, "policy", parent=None)
    local = download_checkpoint_files(
        layout, 0, "policy", include=lambda name: name.endswith(".json"), cache_dir=tmp_path / "cache"
    )
    assert local.name.startswith("files-") and manifest.sha256 not in local.name  # named by the files it holds
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == ["hf/config.json"]
    assert (local / "hf" / "config.json").read_bytes() == (source / "hf" / "config.json").read_bytes()

    damaged = local / "hf" / "config.json"
    damaged.write_text('{"model_type": "llama"}')  # same length would pass a size check; sha256 does not
    again = download_checkpoint_files(
        layout, 0, "policy", include=lambda name: name.endswith(".json"), cache_dir=tmp_path / "cache"
    )
    assert (again / "hf" / "config.json").read_bytes() == (source / "hf" / "config.json").read_bytes()

    def no_download(*args: object) -> None:
        raise AssertionError("downloaded although cached")

    monkeypatch.setattr(ObjectStore, "get_to_local", no_download)
    assert (
        download_checkpoint_files(
            layout, 0, "policy", include=lambda name: name.endswith(".json"), cache_dir=tmp_path / "cache"
        )
        == local
    )
    with pytest.raises(FileNotFoundError, match="no file"):
        download_checkpoint_files(layout, 0, "policy", include=lambda name: False, cache_dir=tmp_path / "cache")


def test_checkpoints_carrying_the_same_files_share_one_partial_folder(layout: RunLayout, tmp_path: Path) -> None:
    """Every policy of a run carries the base model's tokenizer files: reading them for each
    iteration fills one folder of the cache, not one per checkpoint."""
    from storage.cache import download_checkpoint_files

    first = upload_checkpoint(_megatron_like(tmp_path / "a", seed=0), layout, 0, "policy", parent=None)
    second = upload_checkpoint(_megatron_like(tmp_path / "b", seed=1), layout, 1, "policy", parent=first)
    assert first.sha256 != second.sha256  # different weights, the same config.json

    def configs(ref: int) -> Path:
        return download_checkpoint_files(
            layout, ref, "policy", include=lambda name: name.endswith(".json"), cache_dir=tmp_path / "cache"
        )

    assert configs(0) == configs(1)
    (tmp_path / "c" / "hf").mkdir(parents=True)
    (tmp_path / "c" / "hf" / "config.json").write_text('{"model_type": "llama"}')
    third = upload_checkpoint(tmp_path / "c", layout, 2, "policy", parent=second)
    assert third.sha256 and configs(2) != configs(0)  # other bytes, another folder
    assert (configs(2) / "hf" / "config.json").read_text() == '{"model_type": "llama"}'


def _file_layout(tmp_path: Path) -> RunLayout:
    layout = RunLayout(str(tmp_path / "runs"), "run")
    create_or_open_run(layout, {"lr": 1e-6})
    return layout


def test_a_handed_over_folder_is_stored_as_hard_links_and_a_users_folder_is_copied(tmp_path: Path) -> None:
    """A file:// store on the scratch folder's file system takes handed-over files as links (no
    copy of the bytes); without `handed_over` the store holds copies of its own."""
    layout = _file_layout(tmp_path)
    handed = _megatron_like(tmp_path / "scratch" / "a")
    own = _megatron_like(tmp_path / "user" / "b", seed=1)
    linked = upload_checkpoint(handed, layout, 0, "policy", parent=None, handed_over=True)
    copied = upload_checkpoint(own, layout, 0, "teacher", parent=None)
    for manifest, source, shared in ((linked, handed, True), (copied, own, False)):
        for entry in manifest.data["files"]:
            stored = Path(layout.store.path(layout.url(entry["path"])))
            local = source / entry["name"]
            assert entry["sha256"] == sha256_local_file(local) == sha256_local_file(stored)
            assert stored.read_bytes() == local.read_bytes()
            assert (stored.stat().st_ino == local.stat().st_ino) is shared, entry["name"]
    assert not list(Path(layout.store.path(layout.checkpoint_dir(0, "policy"))).rglob(".*.tmp*"))


def test_a_store_on_another_file_system_copies_a_handed_over_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    from storage.errors import StorageIOError

    layout = _file_layout(tmp_path)
    local = tmp_path / "scratch" / "w.bin"
    local.parent.mkdir()
    local.write_bytes(np.random.default_rng(3).bytes(10_000))
    url = layout.url("blobs/w.bin")

    def refuse(code: int):  # type: ignore[no-untyped-def]
        def link(*args: object) -> None:
            raise OSError(code, os.strerror(code))

        return link

    monkeypatch.setattr(os, "link", refuse(errno.EXDEV))
    assert layout.store.put_local_file(local, url, link=True) == sha256_local_file(local)
    stored = Path(layout.store.path(url))
    assert stored.read_bytes() == local.read_bytes() and stored.stat().st_ino != local.stat().st_ino
    # any other refusal is an error, naming the object
    monkeypatch.setattr(os, "link", refuse(errno.EACCES))
    with pytest.raises(StorageIOError, match="v.bin"):
        layout.store.put_local_file(local, layout.url("blobs/v.bin"), link=True)
    assert not list(stored.parent.glob(".*.tmp*"))


def test_an_upload_replaces_the_file_at_its_target_and_never_writes_into_it(tmp_path: Path) -> None:
    """The file at an upload's target may share its bytes with another name (a hard link into the
    cache): an upload renames a new file onto the target, so the other name keeps its bytes."""
    layout = _file_layout(tmp_path)
    url = layout.url("blobs/x.bin")
    first, second = tmp_path / "first.bin", tmp_path / "second.bin"
    first.write_bytes(b"a" * 5000)
    second.write_bytes(b"b" * 3000)
    layout.store.put_local_file(first, url, link=True)
    assert Path(layout.store.path(url)).stat().st_ino == first.stat().st_ino
    for link in (False, True):
        layout.store.put_local_file(second, url, link=link)
        assert first.read_bytes() == b"a" * 5000
        assert Path(layout.store.path(url)).read_bytes() == b"b" * 3000


def test_a_weights_file_hashed_as_it_was_written_is_not_read_again_to_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`write_local_hashing` returns the sha256 of the bytes it wrote; an upload told that digest
    takes a handed-over file as a link without reading it, while a copy (which reads the bytes
    anyway) must match it, and a digest for a file the folder lacks is refused."""
    import hashlib

    from storage import objects
    from storage.hashing import write_local_hashing

    rng = np.random.default_rng(0)
    data = rng.bytes(3 * 8 * 2**20 + 12345)  # several hash chunks and a partial one
    folder = _megatron_like(tmp_path / "scratch" / "a")
    weights = folder / "hf" / "model.safetensors"
    written = write_local_hashing(weights, data)
    assert written == hashlib.sha256(data).hexdigest() == sha256_local_file(weights)
    assert weights.read_bytes() == data

    layout = _file_layout(tmp_path)
    hashed: list[str] = []
    reading = objects.sha256_local_file
    monkeypatch.setattr(objects, "sha256_local_file", lambda path: hashed.append(str(path)) or reading(path))
    linked = upload_checkpoint(
        folder, layout, 0, "policy", parent=None, handed_over=True, written={"hf/model.safetensors": written}
    )
    assert not [p for p in hashed if p.endswith("model.safetensors")], hashed  # the other files are read
    assert {e["name"]: e["sha256"] for e in linked.data["files"]}["hf/model.safetensors"] == written

    own = _megatron_like(tmp_path / "user" / "b")
    with pytest.raises(ValueError, match="changed after it was written"):
        upload_checkpoint(own, layout, 0, "teacher", parent=None, written={"hf/model.safetensors": "0" * 64})
    with pytest.raises(ValueError, match=r"holds no files \['hf/missing'\]"):
        upload_checkpoint(own, layout, 1, "teacher", parent=None, written={"hf/missing": "0" * 64})
