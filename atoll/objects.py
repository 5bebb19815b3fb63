"""State in an S3-compatible object store: the coordinator's (``--state-dir s3://bucket/prefix``) and
the islands' checkpoints (``--checkpoint-dir s3://...``).

The store is the durable copy; each works on a machine-local copy of it (the coordinator:
:mod:`~atoll.coordinator.disk.mirror`), so every reader and writer of the files stays as it is.
This module is the store itself (:class:`ObjectStore`: objects under one prefix); the one-writer
rule without a shared disk is :class:`atoll.lease.Lease`.

Client: boto3. Measured against obstore on SeaweedFS on this 2-core machine (130 MB objects,
loopback): PUT 0.98 s against 0.80 s, GET 0.27 s against 0.21 s; boto3 was chosen for the
standard AWS credential chain as every operator knows it (environment, ``~/.aws/config`` and
``credentials``, profiles, SSO, instance roles) and for conditional writes by name
(``IfNoneMatch``/``IfMatch``). The endpoint comes from the same chain: ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``, or ``endpoint_url`` in the profile) for a store that is not AWS; TLS when
that URL is ``https://``. boto3 is an optional dependency: ``pip install 'atoll[s3]'``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from atoll.errors import UserError
from atoll.net import is_loopback_host

SCHEME = "s3://"
LEASE = "lease.json"
PART_BYTES = 256 << 20
"""Files this large and larger are uploaded in parts of this size (S3: at most 5 GB in one PUT)."""
PARALLEL_PARTS = 4
BACKGROUND_PART_BYTES = 32 << 20
"""A background upload (:meth:`ObjectStore.put_file` with ``yield_to``) goes in parts this large, one at
a time, so a commit on the critical path waits for one part at most."""

log = logging.getLogger("atoll.coordinator")


def is_url(where) -> bool:
    return isinstance(where, str) and where.startswith(SCHEME)


class StoreError(UserError):
    """The store refused or failed an operation, or a run's lease is held; one line naming the object."""


class Conflict(StoreError):
    """A conditional write lost: the object exists, or changed since it was read."""


class Missing(StoreError):
    """The object does not exist (or no longer: pruned by a live coordinator since it was listed)."""


@dataclass(frozen=True)
class ObjectStore:
    bucket: str
    prefix: str
    """Without a trailing slash; every object of the state is ``prefix/<relative path>``."""
    timeout_seconds: float | None = field(default=None, compare=False)
    """Each request's connect and read timeout, tried once (the caller retries): the lease's, which must
    hear of a stalled store within its time. None: the client's defaults with its retries (60 s reads,
    5 attempts: a large part over a slow link)."""

    @classmethod
    def from_url(cls, url: str) -> ObjectStore:
        rest = url[len(SCHEME) :] if is_url(url) else ""
        bucket, _, prefix = rest.partition("/")
        if not bucket or not prefix.strip("/"):
            raise StoreError(f"{url!r}: a state in object storage is s3://BUCKET/PREFIX (a prefix is required)")
        return cls(bucket, prefix.strip("/"))

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}"

    def default_work_dir(self, kind: str) -> Path:
        """Where a machine-local working copy of this prefix goes unless one is given: under the
        system's temp dir, ``atoll-<kind>/<bucket>/<prefix>``."""
        return Path(tempfile.gettempdir()) / f"atoll-{kind}" / self.bucket / self.prefix

    def child(self, name: str) -> ObjectStore:
        return ObjectStore(self.bucket, f"{self.prefix}/{name}", self.timeout_seconds)

    def within(self, seconds: float) -> ObjectStore:
        """The same store, each request given up after ``seconds`` of silence, tried once."""
        return replace(self, timeout_seconds=seconds)

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    @property
    def client(self):
        return _client(self.timeout_seconds)

    @property
    def on_this_machine(self) -> bool:
        """Whether the store's endpoint is a loopback address (a store serving from this machine's own
        cores, as the tests' and benchmarks' SeaweedFS does)."""
        return is_loopback(self.client.meta.endpoint_url)

    # ---- objects ---------------------------------------------------------------------------------
    def put_file(self, path: Path, rel: str, *, create_only: bool = False, yield_to=None) -> str:
        """Upload a local file as ``rel``; its ETag. ``create_only``: Conflict if ``rel`` exists. A file
        of ``PART_BYTES`` or more goes up in parts, ``PARALLEL_PARTS`` at a time (S3 takes at most 5 GB
        in one PUT; a 1B model's snapshot is more), completed create-only where asked. ``yield_to()``:
        called before each part (and before a whole file): an upload in the background waits there
        while one on the critical path runs."""
        size = Path(path).stat().st_size
        if yield_to is not None:
            yield_to()
        if size >= PART_BYTES or (yield_to is not None and size >= BACKGROUND_PART_BYTES):
            part_bytes = PART_BYTES if yield_to is None else BACKGROUND_PART_BYTES
            return self._put_parts(
                Path(path), rel, size, create_only=create_only, part_bytes=part_bytes, yield_to=yield_to
            )
        with open(path, "rb") as f:
            return self._put(rel, f, create_only=create_only)

    def _put_parts(self, path: Path, rel: str, size: int, *, create_only: bool, part_bytes: int, yield_to=None) -> str:
        upload = self.begin_parts(rel)

        def part(n: int) -> dict:
            if yield_to is not None:
                yield_to()
            start = (n - 1) * part_bytes
            with open(path, "rb") as f:
                f.seek(start)
                body = f.read(min(part_bytes, size - start))
            return self.put_part(rel, upload, n, body)

        try:
            with ThreadPoolExecutor(PARALLEL_PARTS if yield_to is None else 1, thread_name_prefix="atoll-put") as pool:
                parts = list(pool.map(part, range(1, -(-size // part_bytes) + 1)))
            return self.complete_parts(rel, upload, parts, create_only=create_only)
        except Exception as err:
            self.abort_parts(rel, upload)
            if isinstance(err, (StoreError, FileNotFoundError)):
                raise  # (FileNotFoundError: the file went meanwhile, superseded and pruned: the caller's to know)
            raise store_error(err, self.url, rel) from None

    # ---- multipart uploads: a large file in parts, a log record as the step makes it -------------
    def begin_parts(self, rel: str) -> str:
        """A new multipart upload of ``rel``: its id."""
        try:
            return self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key(rel))["UploadId"]
        except Exception as err:
            raise store_error(err, self.url, rel) from None

    def put_part(self, rel: str, upload: str, number: int, body) -> dict:
        """Part ``number`` (from 1) of ``upload``; what :meth:`complete_parts` takes for it."""
        try:
            got = self.client.upload_part(
                Bucket=self.bucket, Key=self.key(rel), UploadId=upload, PartNumber=number, Body=body
            )
        except Exception as err:
            raise store_error(err, self.url, rel) from None
        return {"PartNumber": number, "ETag": got["ETag"]}

    def complete_parts(self, rel: str, upload: str, parts: list[dict], *, create_only: bool) -> str:
        """The object made of ``parts`` (in order); its ETag. ``create_only``: Conflict if ``rel`` exists."""
        kw = {"IfNoneMatch": "*"} if create_only else {}
        try:
            done = self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=self.key(rel), UploadId=upload, MultipartUpload={"Parts": parts}, **kw
            )
        except Exception as err:
            raise store_error(err, self.url, rel) from None
        return done["ETag"]

    def abort_parts(self, rel: str, upload: str) -> None:
        """Drop ``upload`` and its parts (best effort: a store that cannot be reached keeps them)."""
        with contextlib.suppress(Exception):
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key(rel), UploadId=upload)

    def put_bytes(self, rel: str, data: bytes, *, create_only: bool = False, if_match: str | None = None) -> str:
        return self._put(rel, data, create_only=create_only, if_match=if_match)

    def _put(self, rel: str, body, *, create_only: bool = False, if_match: str | None = None) -> str:
        kw = {"IfNoneMatch": "*"} if create_only else {"IfMatch": if_match} if if_match else {}
        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key(rel), Body=body, **kw)["ETag"]
        except Exception as err:
            raise store_error(err, self.url, rel) from None

    def get(self, rel: str) -> tuple[bytes, str] | None:
        """(bytes, ETag) of ``rel``, or None when it does not exist."""
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key(rel))
            return got["Body"].read(), got["ETag"]
        except Exception as err:
            if _code(err) in ("NoSuchKey", "404"):
                return None
            raise store_error(err, self.url, rel) from None

    def get_range(self, rel: str, start: int, size: int) -> bytes:
        """Bytes ``start .. start + size`` of ``rel`` (fewer where it ends first); Missing when it is gone."""
        try:
            got = self.client.get_object(
                Bucket=self.bucket, Key=self.key(rel), Range=f"bytes={start}-{start + size - 1}"
            )
            return got["Body"].read()
        except Exception as err:
            raise store_error(err, self.url, rel) from None

    def download(self, rel: str, path: Path) -> None:
        """``rel`` into the local ``path`` (a temporary file renamed over it: never a partial one)."""
        tmp = path.with_name(f".{path.name}.download")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.client.download_file(self.bucket, self.key(rel), str(tmp))
            os.replace(tmp, path)
        except Exception as err:
            tmp.unlink(missing_ok=True)
            raise store_error(err, self.url, rel) from None

    def listing(self) -> dict[str, int]:
        """Every object under the prefix: relative path -> size."""
        out: dict[str, int] = {}
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + "/")
            for page in pages:
                for obj in page.get("Contents", ()):
                    out[obj["Key"][len(self.prefix) + 1 :]] = int(obj["Size"])
        except Exception as err:
            raise store_error(err, self.url, "") from None
        return out

    def delete(self, rel: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key(rel))
        except Exception as err:
            raise store_error(err, self.url, rel) from None


def is_loopback(url: str) -> bool:
    return is_loopback_host(urllib.parse.urlparse(url).hostname or "")


_CLIENTS: dict[float | None, object] = {}
_CLIENT_LOCK = threading.Lock()


def _client(timeout: float | None = None):
    """One boto3 client per process and timeout (thread-safe; its connection pool is shared)."""
    with _CLIENT_LOCK:
        if timeout not in _CLIENTS:
            try:
                import boto3
                from botocore.config import Config
            except ImportError:
                raise StoreError("a state in object storage needs boto3: pip install 'atoll[s3]'") from None
            # The files carry their own CRC-32C per tensor (checked at load): no second checksum pass
            # over them on every PUT (botocore's default since 1.36).
            bounded = {} if timeout is None else {"connect_timeout": timeout, "read_timeout": timeout}
            config = Config(
                retries={"total_max_attempts": 6 if timeout is None else 1, "mode": "standard"},
                max_pool_connections=16,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                **bounded,
            )
            client = boto3.session.Session().client("s3", config=config)
            if timeout is not None:  # small bodies: no second wait (up to 1 s) for a "100 Continue" first
                client.meta.events.register_last("before-call.s3", _no_expect_continue)
            _CLIENTS[timeout] = client
        return _CLIENTS[timeout]


def _no_expect_continue(params, **_) -> None:
    params["headers"].pop("Expect", None)


def close_client() -> None:
    """Close the process's clients (their pooled connections): a server shutting down waits for them."""
    with _CLIENT_LOCK:
        for client in _CLIENTS.values():
            client.close()
        _CLIENTS.clear()


def _code(err) -> str:
    response = getattr(err, "response", None) or {}
    return str(response.get("Error", {}).get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def store_error(err, url: str, rel: str) -> StoreError:
    """A boto3 failure as one line naming the object: Conflict for a lost conditional write."""
    code = _code(err)
    where = f"{url}/{rel}" if rel else url
    if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
        return Conflict(f"{where}: changed by another writer ({code})")
    if code in ("NoSuchKey", "404"):
        return Missing(f"{where}: no such object")
    if code == "NoSuchBucket":
        return StoreError(f"{url}: the bucket {url[len(SCHEME) :].partition('/')[0]} does not exist; create it first")
    return StoreError(f"{where}: {type(err).__name__}: {err}")
