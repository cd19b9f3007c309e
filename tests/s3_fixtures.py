"""A local S3 endpoint for the suite: moto's threaded server on 127.0.0.1 (a free port it binds),
one per module, and a fresh bucket per test with the environment a checkpoint store (or a
service process) reads: ``AWS_ENDPOINT_URL`` and dummy credentials.

Make the fixtures a test module's own where they are used::

    s3_endpoint = s3_fixtures.s3_endpoint
    s3_bucket = s3_fixtures.s3_bucket
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

#: What a client of the local endpoint needs in its environment.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class S3Bucket:
    """A fresh bucket on the local endpoint.

    Attributes:
        endpoint: ``http://127.0.0.1:PORT``.
        name: The bucket.
        env: The variables a process needs to reach it (endpoint and credentials).
    """

    endpoint: str
    name: str
    env: dict[str, str]

    def url(self, prefix: str = "checkpoints") -> str:
        """``s3://bucket/prefix``."""
        return f"s3://{self.name}/{prefix}"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 for the module; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3Bucket:
    """A new bucket, with this process's environment pointing at the endpoint."""
    import boto3

    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_endpoint}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    name = f"trainwire-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )
    client.create_bucket(Bucket=name)
    return S3Bucket(s3_endpoint, name, env)
