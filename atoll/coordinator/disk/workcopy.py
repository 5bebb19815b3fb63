"""The machine-local working copy of a state kept in an object store: the coordinator's own cache.

With ``--state-dir s3://bucket/prefix`` the store is the truth, and the state dir the coordinator reads
and writes (``--work-dir``, by default under the system's temp dir) is a cache of it. The rules:

- **Marked.** A working copy holds :data:`MARK` (the store's URL and the run): :func:`check_dir`
  refuses, with one line and before anything touches it, a dir that is neither new nor empty nor a
  working copy of that same URL (an existing local run's state dir, another store's copy, a home dir).
- **Reconciled against the store** (:func:`reconcile`): the run's own files (:func:`~atoll.coordinator.
  disk.snapshots.state_file`: the canonical names of snapshots, log records, the optimizer file,
  ``head.json``, ``membership.json``) that the store lacks were never durable and go; a file the store
  holds is kept only when its content is the store's (its header, which names every tensor's checksum,
  equal to the object's, and every checksum verified), else fetched again: a damaged copy is mended from
  the store, and a same-size record of another run is never trusted.
- **Nothing else is removed**, and nothing but the run's own names is fetched (a stray object is named
  in a WARNING and left in the store).
- **A wiped store is not a fresh run.** A store that holds no run while the copy holds published rounds
  is refused with a line that names both and how to put the copy back (``atoll restore-store``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from atoll.coordinator.disk import snapshots, wal
from atoll.coordinator.disk.lock import LOCK
from atoll.coordinator.disk.verified import IntegrityError, check_file, header_of
from atoll.files import write_atomic
from atoll.objects import LEASE, Missing, ObjectStore, StoreError

log = logging.getLogger("atoll.coordinator")

MARK = ".atoll-working-copy.json"
FORMAT = "atoll-working-copy-1"
ATTEMPTS = 5
"""Listings a reconcile makes when an object it listed is gone before it is fetched (a live coordinator
pruned it: ``atoll export`` of a running run) before it gives up."""


def _mark_of(local: Path) -> dict | None:
    path = local / MARK
    try:
        mark = json.loads(path.read_text())
        if not isinstance(mark, dict) or mark.get("format") != FORMAT or not isinstance(mark.get("store"), str):
            raise ValueError("not a working copy's mark")
        return mark
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise StoreError(f"{path}: unreadable ({err}); this dir is not a working copy atoll can trust") from None


def check_dir(local: Path, store: ObjectStore) -> None:
    """StoreError (one line) unless ``local`` is new, empty, or a working copy of ``store``; reads only."""
    local = Path(local)
    if not local.exists():
        return
    if not local.is_dir():
        raise StoreError(f"--work-dir {local} is not a directory")
    mark = _mark_of(local)
    if mark is None:
        found = sorted(p.name for p in local.iterdir() if p.name != LOCK)
        if found:
            shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
            raise StoreError(
                f"{local} is not a working copy of {store.url}: it holds {shown} and no {MARK}; a working copy "
                "is the coordinator's own cache and atoll removes nothing it does not own: give --work-dir a new "
                "or empty dir (a copy an older atoll made has no mark: remove it, the store holds the run)"
            )
        return
    if mark["store"] != store.url:
        raise StoreError(
            f"{local} is the working copy of {mark['store']}, not of {store.url}: give --work-dir another dir"
        )


def _mark(local: Path, store: ObjectStore, run_id: str | None) -> None:
    old = _mark_of(local) or {}
    mark = {"format": FORMAT, "store": store.url, "run_id": run_id or old.get("run_id")}
    if mark != old:
        write_atomic(local / MARK, [json.dumps(mark).encode()], durable=False)


def _local_state(local: Path) -> dict[str, Path]:
    """The run's own files under ``local`` (no temporary, no lock, nothing else)."""
    out = {}
    for p in local.rglob("*"):
        rel = p.relative_to(local).as_posix()
        if p.is_file() and snapshots.state_file(rel):
            out[rel] = p
    return out


def _holds_a_run(rels) -> bool:
    """Whether these state files hold published rounds: a record, ``head.json``, a snapshot past θ_0 (a
    θ_0 snapshot alone may be a bootstrap that never reached the store)."""
    for rel in rels:
        name = Path(rel).name
        if name == snapshots.HEAD or wal.RECORD.fullmatch(name):
            return True
        if snapshots.canonical(name) and snapshots.read_round(Path(name)) > 0:
            return True
    return False


def _same(store: ObjectStore, rel: str, path: Path, size: int) -> bool:
    """Whether the local file holds the store's object, compared by content: the same size, the same
    header (which names every tensor's checksum), and every checksum verified (a damaged copy: False)."""
    if path.stat().st_size != size:
        return False
    try:
        head, names_content = header_of(path)
        if not names_content:  # (a record written before headers named its payloads: fetched again)
            return False
        if store.get_range(rel, 0, len(head)) != head:
            return False
        check_file(path, require_meta_digest=False)
    except IntegrityError:
        return False
    return True


def reconcile(store: ObjectStore, local: Path, run_id: str | None = None) -> tuple[dict[str, Path], int]:
    """Make ``local`` (checked by :func:`check_dir`, marked here) the store's copy of the run's files, as
    described above; (the run's files, by relative path; the bytes fetched). The lease, where one is
    taken, is held already."""
    local = Path(local)
    check_dir(local, store)
    local.mkdir(parents=True, exist_ok=True)
    for attempt in range(ATTEMPTS):
        try:
            return _reconcile(store, local, run_id)
        except Missing as err:
            if attempt == ATTEMPTS - 1:
                raise StoreError(f"{err}: the run changed under every one of {ATTEMPTS} listings") from None
            log.info("%s; listing %s again (a live coordinator pruned it)", err, store.url)
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _reconcile(store: ObjectStore, local: Path, run_id: str | None) -> tuple[dict[str, Path], int]:
    head = store.get(snapshots.HEAD)  # before the listing: every record before its round is listed
    listed = store.listing()
    remote = {rel: size for rel, size in listed.items() if snapshots.state_file(rel)}
    strays = sorted(rel for rel in listed if rel not in remote and not _kept_in_store(rel))
    if strays:
        log.warning(
            "%s holds %d objects that are not the run's files (%s): not fetched",
            store.url,
            len(strays),
            ", ".join(strays[:3]) + (", ..." if len(strays) > 3 else ""),
        )
    mine = _local_state(local)
    if not _holds_a_run(remote) and _holds_a_run(mine):
        held = snapshots.read_head(local) if (local / snapshots.HEAD).exists() else None
        mark = _mark_of(local) or {}
        raise StoreError(
            f"{store.url} holds no run, but its working copy {local} holds run {mark.get('run_id') or '?'}"
            + (f" up to round {held}" if held is not None else "")
            + f": the store lost it (wiped, or another endpoint?). To put the run back in the store: "
            f"`atoll restore-store --from {local} --state-dir {store.url}`; to start a new run there instead, "
            "give --work-dir a new dir (this one is left as it is)"
        )
    _mark(local, store, run_id)
    for rel, path in mine.items():
        if rel not in remote:
            path.unlink()  # never durable: the store is the truth
    got = 0
    for rel, size in sorted(remote.items()):
        path = local / rel
        if path.suffix != ".safetensors":  # small JSON (head, departures): compared whole
            body = head[0] if rel == snapshots.HEAD and head is not None else (store.get(rel) or (None,))[0]
            if body is None:
                raise Missing(f"{store.url}/{rel}: no such object")
            if not path.exists() or path.read_bytes() != body:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, [body], durable=False)
                got += len(body)
        elif not path.exists() or not _same(store, rel, path, size):
            store.download(rel, path)
            got += size
    return {rel: local / rel for rel in remote}, got


def _kept_in_store(rel: str) -> bool:
    """Objects of the run's prefix that are not fetched and not strays: the lease, what a rollback set
    aside."""
    parts = rel.split("/")
    return parts[-1] == LEASE or snapshots.DISCARDED in parts
