"""The operator's commands: ``atoll status``, ``atoll export``, ``atoll rollback`` and ``atoll restore-store``."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from atoll.coordinator.disk import snapshots
from atoll.coordinator.disk.lock import StateLock
from atoll.errors import UserError


def _fail(message: str) -> UserError:
    return UserError(message)


def fetch_status(admin: str, token: str | None) -> dict:
    url = admin.rstrip("/") + "/api/status"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raise _fail(f"{url}: HTTP {err.code} {err.read().decode(errors='replace').strip()[:200]}") from None
    except (urllib.error.URLError, OSError) as err:
        raise _fail(f"{url}: {getattr(err, 'reason', err)}") from None
    except (http.client.HTTPException, ValueError) as err:  # (not HTTP, or not JSON: the gRPC port, say)
        raise _fail(
            f"{url} did not answer as a coordinator's admin endpoint ({type(err).__name__}); --admin is the "
            "coordinator's --admin-port, not its gRPC --port"
        ) from None


def _age(seconds) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def format_status(s: dict) -> str:
    run = s["run"]
    total = run.get("total_rounds") or 0
    lines = [
        f"run {run['run_id']}: round {s['round']}"
        + (f" of {total}" if total else "")
        + (" (complete)" if s.get("run_complete") else "")
        + f", {s.get('num_params', 0):,} parameters, H={run['sync_every']}, codec {run['codec']},"
        f" outer lr {run['outer_lr']} / momentum {run['outer_momentum']}, quorum {run['quorum']}",
        "health: " + ("ok" if s.get("healthy", True) else f"UNHEALTHY: {s.get('problem')}"),
    ]
    if s.get("run_complete"):
        pass  # nothing waits any more
    elif s.get("stall"):
        lines.append(f"stalled: {s['stall']}")
    elif s.get("waiting"):
        lines.append(f"now: {s['waiting']}")
    lines.append("")
    if s.get("goodput") is not None:
        lines.append(f"goodput: {s['goodput']:.0%} of island time computed what entered θ")
    lines.append(f"{'island':<24} {'state':<8} {'ranks':>5} {'rounds':>6} {'last push':>9} {'goodput':>7}")
    for i in s["islands"]:
        goodput = "-" if i.get("goodput") is None else f"{i['goodput']:.0%}"
        lines.append(
            f"{i['island']:<24} {i['state']:<8} {i.get('num_ranks', '-'):>5} {i.get('rounds_committed', '-'):>6} "
            f"{_age(i.get('last_push_age_seconds')):>9} {goodput:>7}"
        )
    lines += [f"warning: {w}" for w in s.get("warnings", [])]
    hist = s.get("history", [])[-5:]
    if hist:
        lines.append("")
        lines.append(f"{'round':>5} {'loss':>8} {'tokens':>12} {'tokens/s':>10} {'seconds':>8} {'islands':>7}")
        for h in hist:
            loss = "-" if h.get("loss") is None else f"{h['loss']:.4f}"
            secs = h.get("seconds_open") or 0  # null: not finite in the record (a warning says so)
            rate = f"{h['tokens'] / secs:,.0f}" if secs else "-"
            lines.append(f"{h['round']:>5} {loss:>8} {h['tokens']:>12,} {rate:>10} {secs:>8.1f} {len(h['islands']):>7}")
    return "\n".join(lines)


def status(ns: argparse.Namespace) -> int:
    print(format_status(fetch_status(ns.admin, ns.token)))
    return 0


def _state_dirs(state_dir: Path) -> list[Path]:
    """The state dir, or the fragments' dirs of a ``--fragments`` coordinator."""
    fragments = sorted(state_dir.glob("fragment-*"), key=lambda p: int(p.name.split("-")[1]))
    return fragments or [state_dir]


def _load_live(state_dir: Path, upto: int | None):
    try:
        return snapshots.load_live(state_dir, upto)
    except snapshots.StateError as err:
        raise _fail(str(err)) from None


@contextlib.contextmanager
def _local_copy(where: str, *, write: str | None = None):
    """The state dir ``where`` as a local path: itself, or for ``s3://bucket/prefix`` a copy of it in a
    temporary dir. ``write`` (what the tool does): take the run's lease first, and put the changes
    back in the store after the block (a coordinator holding it refuses the tool)."""
    from atoll.coordinator.disk.mirror import Mirror
    from atoll.objects import ObjectStore, is_url

    if not is_url(where):
        yield Path(where)
        return
    with tempfile.TemporaryDirectory(prefix="atoll-state-") as tmp:
        mirror = Mirror.open(ObjectStore.from_url(where), Path(tmp), lease_seconds=30.0 if write else None)
        try:
            yield Path(tmp)
            if write:
                mirror.sync()
        finally:
            mirror.close()


def export(ns: argparse.Namespace) -> int:
    """θ with the model's own tensor names, the newest (or a kept round's: a snapshot and the log after it),
    verified."""
    with _local_copy(ns.state_dir) as state_dir:
        return _export(ns, state_dir)


def _export(ns: argparse.Namespace, state_dir: Path) -> int:
    from safetensors.torch import save_file

    from atoll.models.card import card_path

    dirs = _state_dirs(state_dir)
    if ns.round is not None and len(dirs) > 1:
        raise _fail("--round picks one round; fragments close rounds on their own (export the newest)")
    params, rounds, run_id, card = {}, [], None, ""
    for d in dirs:
        snap = _load_live(d, ns.round)
        if snap is None:
            raise _fail(f"{d} holds no snapshot")
        params.update(snap.params)
        for name, others in snap.aliases.items():  # tied weights: the same values under every name
            params.update({alias: snap.params[name].clone() for alias in others})  # no shared storage in a file
        rounds.append(snap.round)
        run_id, card = snap.config.run_id, card or snap.model_card
    fmt = "pt" if ns.hf_dir is not None else "atoll-export-1"  # ("pt": what transformers checks in a model dir)
    meta = {"run_id": run_id, "round": ",".join(map(str, rounds)), "format": fmt, "model_card": card}
    if ns.hf_dir is not None:
        parsed = json.loads(card) if card else {}
        if parsed.get("format") != "hf":
            raise _fail(
                f"run {run_id}'s islands did not say their model is a Hugging Face one (its card: "
                f"{(card or 'none')[:80]}); --hf-dir needs one: export with --out"
            )
        ns.hf_dir.mkdir(parents=True, exist_ok=True)
        out, written = ns.hf_dir / "model.safetensors", [ns.hf_dir / "config.json"]
        _write_readable(written[0], json.dumps(parsed["config"], indent=2, sort_keys=True).encode())
    else:
        out, written = ns.out, []
        out.parent.mkdir(parents=True, exist_ok=True)
        if card:
            written.append(card_path(out))
            _write_readable(written[0], json.dumps(json.loads(card), indent=2, sort_keys=True).encode())
    save_file({k: v.contiguous() for k, v in sorted(params.items())}, str(out), metadata=meta)
    _readable(out)
    numel = sum(v.numel() for v in params.values())
    beside = f" (and {', '.join(str(p) for p in written)})" if written else " (no model card: the islands said none)"
    print(f"wrote {len(params)} tensors ({numel:,} values) of run {run_id} at round {meta['round']} to {out}{beside}")
    return 0


def _readable(path: Path) -> None:
    """An export is for others to read: the mode a new file gets under the umask (safetensors writes
    0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _write_readable(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    _readable(path)


def rollback(ns: argparse.Namespace) -> int:
    try:
        with _local_copy(ns.state_dir, write="rolling it back" if ns.round is not None else None) as state_dir:
            return _rollback(ns, state_dir)
    except snapshots.StateError as err:
        raise _fail(str(err)) from None


def _rollback(ns: argparse.Namespace, state_dir: Path) -> int:
    if ns.round is None:
        listed = snapshots.list_snapshots(state_dir)
        if not listed:
            raise _fail(f"{ns.state_dir} holds no snapshots")
        for round_, path, problem in listed:
            print(f"round {round_:<6} {path.name}  {'ok' if problem is None else 'DAMAGED: ' + problem}")
        try:  # the newest snapshot with the log after it, as a restart would load it
            snap = snapshots.load(state_dir)
            print(f"restores round {snap.round} (the newest snapshot and the log after it)")
        except snapshots.StateError as err:
            print(f"does not restore: {err}")
        return 0
    lock = StateLock(state_dir).acquire("rolling it back")
    try:
        target = snapshots.rollback(state_dir, ns.round)
    finally:
        lock.release()
    print(f"rolled back: {target.name} is now the newest snapshot (newer ones moved to {snapshots.DISCARDED}/)")
    return 0


def restore_store(ns: argparse.Namespace) -> int:
    """Put the run of a local state dir (a coordinator's working copy whose store lost it) into an object
    store that holds no run: verified first, under the store's lease, each file create-only."""
    from atoll.lease import Lease
    from atoll.objects import ObjectStore, is_url

    if not is_url(ns.state_dir):
        raise _fail(f"--state-dir {ns.state_dir!r}: the store to put the run in, s3://BUCKET/PREFIX")
    store = ObjectStore.from_url(ns.state_dir)
    source = Path(ns.source)
    snap = _load_live(source, None) if source.is_dir() else None
    if snap is None:
        raise _fail(f"{source} holds no run to put in the store")
    files = sorted(
        p for p in source.rglob("*") if p.is_file() and snapshots.state_file(p.relative_to(source).as_posix())
    )
    lease = Lease(store, 30.0).acquire()
    try:
        held = sorted(rel for rel in store.listing() if snapshots.state_file(rel))
        if held:
            raise _fail(f"{store.url} holds a run already ({', '.join(held[:3])}); it is never written over")
        for path in files:
            store.put_file(path, path.relative_to(source).as_posix(), create_only=True)
    finally:
        lease.release()
    print(f"put run {snap.config.run_id} (round {snap.round}) in {store.url}: {len(files)} files from {source}")
    return 0
