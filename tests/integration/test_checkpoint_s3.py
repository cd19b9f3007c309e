"""The checkpoint store at an ``s3://`` URL, through s3fs, against a local S3 endpoint (moto's
server, started by the test): the same round trip, digest, invisibility of unmarked
checkpoints, corruption and deletion as on a directory, and one digest for the same files in
both kinds of store."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import boto3
import pytest

from tests import s3_fixtures
from tests.s3_fixtures import S3Bucket
from tests.unit.test_checkpoint_store import make_checkpoint, read_tree
from trainwire_ops.checkpoints import (
    CheckpointCorrupt,
    CheckpointMissing,
    CheckpointStore,
    CheckpointStoreProblem,
)

s3_endpoint = s3_fixtures.s3_endpoint
s3_bucket = s3_fixtures.s3_bucket


def _client(bucket: S3Bucket):  # type: ignore[no-untyped-def]
    return boto3.client("s3", endpoint_url=bucket.endpoint, region_name="us-east-1")


def test_round_trip_and_digest(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    store = CheckpointStore(s3_bucket.url())
    store.check()
    files = make_checkpoint(tmp_path / "local")
    info = store.put("run-1", 12, tmp_path / "local", {"best_reward": 0.5})
    assert store.info("run-1", 12) == info
    assert store.episodes("run-1") == [12]

    data = b"".join(store.tar_chunks("run-1", 12, chunk_size=4096))
    assert hashlib.sha256(data).hexdigest() == info.sha256
    assert len(data) == info.size_bytes
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        assert sorted(archive.getnames()) == sorted(files)

    store.fetch("run-1", 12, tmp_path / "back", info.sha256)
    assert read_tree(tmp_path / "back") == files

    # The same files in a directory store have the same record.
    local = CheckpointStore(str(tmp_path / "dir-store")).put("run-1", 12, tmp_path / "local", {})
    assert (local.sha256, local.size_bytes) == (info.sha256, info.size_bytes)


def test_unmarked_and_corrupt_checkpoints(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    store = CheckpointStore(s3_bucket.url("prefix/deeper"))
    make_checkpoint(tmp_path / "local")
    info = store.put("run-1", 1, tmp_path / "local", {})
    store.put("run-1", 2, tmp_path / "local", {})
    client = _client(s3_bucket)
    base = "prefix/deeper/run-1"
    client.delete_object(Bucket=s3_bucket.name, Key=f"{base}/{2:012d}.json")  # upload died
    assert store.episodes("run-1") == [1]
    with pytest.raises(CheckpointMissing):
        store.fetch("run-1", 2, tmp_path / "two", info.sha256)

    client.put_object(
        Bucket=s3_bucket.name, Key=f"{base}/{1:012d}/checkpoint.json", Body=b'{"episode": 6}'
    )
    with pytest.raises(CheckpointCorrupt, match="digest mismatch"):
        store.fetch("run-1", 1, tmp_path / "one", info.sha256)
    assert list((tmp_path / "one").iterdir()) == []


def test_delete(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    store = CheckpointStore(s3_bucket.url())
    make_checkpoint(tmp_path / "local")
    for episode in (1, 2):
        store.put("run-1", episode, tmp_path / "local", {})
    store.delete("run-1", 1)
    store.delete("run-1", 1)
    assert store.episodes("run-1") == [2]
    store.delete_run("run-1")
    store.delete_run("run-1")
    assert store.episodes("run-1") == []
    listing = _client(s3_bucket).list_objects_v2(Bucket=s3_bucket.name)
    assert listing.get("KeyCount", 0) == 0


def test_missing_bucket_is_one_line(s3_bucket: S3Bucket) -> None:
    store = CheckpointStore(f"s3://{s3_bucket.name}-absent/checkpoints")
    with pytest.raises(CheckpointStoreProblem) as caught:
        store.check()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint store s3://{s3_bucket.name}-absent/checkpoints: ")
