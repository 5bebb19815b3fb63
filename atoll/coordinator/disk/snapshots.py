"""The coordinator's state on disk: verified snapshots, the write-ahead log, departures.

``STATE_DIR/snapshot-<round>.safetensors`` holds θ, the outer optimizer's buffers and the
downlink error feedback, plus (metadata) the round, run config, membership, history and a
CRC-32C per tensor. It is written to a temporary file, fsynced, renamed and the directory
fsynced: a crash leaves the previous snapshot or the new one, never a mix. θ_0's is written before
θ_0 is published; later ones in the background every few rounds (:mod:`atoll.coordinator.disk.wal`),
while each round is made durable by its log record before it is published. :func:`load` is the
newest snapshot plus the log replayed after it. The newest ``keep`` snapshots stay; a damaged
newest one, or a damaged log, is refused, never silently replaced by older state: an operator rolls
back explicitly (:func:`rollback`, ``atoll rollback``).

``membership.json`` holds the islands that left or were evicted (written at once, so a restart does
not bring them back). ``head.json`` holds the newest round published (written in the background after
each publish, so it never runs ahead of the log): a restore that reaches less (the log removed, or its
newest records) is refused, never a silent rollback.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from atoll.coordinator.config import RunConfig
from atoll.coordinator.disk import wal
from atoll.coordinator.disk.verified import META_DIGEST, IntegrityError, check_file, write_file
from atoll.files import fsync_dir, write_atomic

FORMAT = "atoll-state-3"
"""Format 3 adds the metadata's own checksum; format 2 snapshots (without it) still load."""
FORMATS = ("atoll-state-2", FORMAT)
SNAPSHOT_NAME = re.compile(r"snapshot-(\d{8,})\.safetensors")
SNAPSHOT_PREFIX = "snapshot-"
SUFFIX = ".safetensors"
UPDATES = "updates"
"""Where older coordinators kept outer updates (now the log's records)."""
MEMBERSHIP = "membership.json"
HEAD = "head.json"
DISCARDED = "discarded"
FRAGMENT = re.compile(r"fragment-(0|[1-9]\d*)")
"""A fragment's state dir inside the state dir of a ``--fragments`` coordinator."""
LEGACY = ("state.safetensors", ".state.safetensors.tmp")


class StateError(ValueError):
    """The state dir cannot be trusted; the message is one line an operator can act on."""


@dataclass
class Snapshot:
    config: RunConfig
    round: int
    """The open round: rounds ``0 .. round-1`` are complete and θ is θ_round."""
    params: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Optimizer and error-feedback tensors, by prefixed name."""
    islands: dict[str, dict] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    departed: dict[str, str] = field(default_factory=dict)
    buffers: tuple[str, ...] = ()
    """Tensors that are floating-point buffers (averaged, no outer momentum)."""
    shard: tuple[int, int] = (0, 1)
    partition: str = "hash"
    layout_digest: str = ""
    """partition "layers": the whole model's layout digest every island must match."""
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Tied weights: a tensor's other names in the model's state_dict."""
    model_card: str = ""
    """What the model is, as JSON (an island's ``model_card``; empty: not said)."""
    notes: list[str] = field(default_factory=list)
    """What a restore wants an operator to know (state it could not bring back exactly)."""


def snapshot_name(round_: int) -> str:
    return f"{SNAPSHOT_PREFIX}{round_:08d}{SUFFIX}"


def snapshot_paths(state_dir: Path) -> list[Path]:
    """Snapshot files, oldest round first (StateError naming a file that looks like one but is not)."""
    d = Path(state_dir)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if p.name.startswith(SNAPSHOT_PREFIX) and p.name.endswith(SUFFIX)]
    stray = sorted(p.name for p in found if not canonical(p.name))
    if stray:
        raise StateError(
            f"{d} holds {stray[0]}, which is not a snapshot name (snapshot-<8-digit round>.safetensors, one "
            "name per round); move it away"
        )
    return sorted(found, key=read_round)


def canonical(name: str) -> bool:
    """Whether ``name`` is the one name of a snapshot of its round."""
    m = SNAPSHOT_NAME.fullmatch(name)
    return m is not None and name == snapshot_name(int(m.group(1)))


def state_file(rel: str) -> bool:
    """Whether ``rel`` (a path relative to a state dir, ``/``-separated) is one of the files a coordinator
    writes there under its canonical name: ``head.json``, ``membership.json``, a snapshot, a log record or
    optimizer file; or one of those in a fragment's dir (``fragment-<i>/...``, ``--fragments``). What a
    working copy fetches from an object store, and the only files it ever removes."""
    parts = rel.split("/")
    if len(parts) > 1 and FRAGMENT.fullmatch(parts[0]):
        parts = parts[1:]
    if len(parts) == 1:
        return parts[0] in (HEAD, MEMBERSHIP) or canonical(parts[0])
    return len(parts) == 2 and parts[0] == wal.LOG and wal.canonical(parts[1])


def read_round(path: Path) -> int:
    return int(SNAPSHOT_NAME.fullmatch(Path(path).name).group(1))


def save(state_dir: Path, snap: Snapshot, *, keep: int | None = 2) -> Path:
    """Write ``snap`` atomically, then drop all but the newest ``keep`` snapshots (None: leave that
    to :func:`prune`, off the critical path: freeing a large file's blocks takes a while)."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"param/{k}": v for k, v in snap.params.items()}
    tensors.update(snap.extra)
    metadata = {
        "format": FORMAT,
        "round": str(snap.round),
        "config": snap.config.to_json(),
        "islands": json.dumps(snap.islands, sort_keys=True),
        "departed": json.dumps(snap.departed, sort_keys=True),
        "history": json.dumps(snap.history),
        "buffers": json.dumps(sorted(snap.buffers)),
        "shard": f"{snap.shard[0]}/{snap.shard[1]}",
        "partition": snap.partition,
        "layout_digest": snap.layout_digest,
        "aliases": json.dumps({k: list(v) for k, v in snap.aliases.items()}, sort_keys=True),
        "model_card": snap.model_card,
    }
    final = state_dir / snapshot_name(snap.round)
    write_file(final, tensors, metadata)
    if keep is not None:
        prune(state_dir, keep)
    return final


def prune(state_dir: Path, keep: int) -> None:
    """Drop all but the newest ``keep`` snapshots."""
    for old in snapshot_paths(state_dir)[:-keep]:
        old.unlink(missing_ok=True)


def _holds_atoll_files(state_dir: Path) -> list[str]:
    d = Path(state_dir)
    if not d.is_dir():
        return []
    names = [p.name for p in d.iterdir()]
    ours = (SNAPSHOT_PREFIX, f".{SNAPSHOT_PREFIX}", wal.LOG, UPDATES, MEMBERSHIP, HEAD, *LEGACY)
    return sorted(n for n in names if n.startswith(ours))


def load(state_dir: Path, upto: int | None = None, *, where: str | None = None) -> Snapshot | None:
    """The newest snapshot, verified, with the log replayed after it; None for a dir with no atoll
    files (a fresh run). ``upto``: θ of that round instead, from the newest snapshot at or before it
    (StateError when neither a snapshot nor the log reaches it).

    Raises :class:`StateError` when the newest snapshot is damaged or inconsistent, or the dir holds
    atoll files but no snapshot, or the snapshot and the log reach back less far than the round the
    dir records as published: a run is never restarted silently from scratch or from the past.
    ``where``: the ``--state-dir`` an operator's command names (an object store's URL, whose working copy
    ``state_dir`` is: rolling that copy back would be undone by the next start); default ``state_dir``."""
    where = where or str(state_dir)
    head = read_head(state_dir) if upto is None else None  # before the log is listed: it never runs ahead
    paths = [p for p in snapshot_paths(state_dir) if upto is None or read_round(p) <= upto]
    stray = wal.strays(state_dir)
    if stray:
        raise StateError(
            f"{Path(state_dir) / wal.LOG} holds {stray[0]}, which is not a log file's name (round-<8-digit "
            "round>.safetensors, one name per round): it is never read in place of a round's record; move it away"
        )
    if not paths and upto is not None:
        raise StateError(f"no snapshot of round {upto} or before in {state_dir}")
    if not paths:
        found = _holds_atoll_files(state_dir)
        if found:
            raise StateError(
                f"{state_dir} holds atoll files ({', '.join(found[:4])}) but no valid snapshot; "
                "refusing to start a fresh run over them (move them away to start one)"
            )
        return None
    try:
        snap = verify(paths[-1])
    except StateError as err:
        older = [str(read_round(p)) for p in paths[:-1]]
        hint = (
            f"; roll back with `atoll rollback --state-dir {where} --round N` (kept rounds: {', '.join(older)})"
            if older
            else "; no older snapshot is kept to roll back to"
        )
        raise StateError(f"{err}{hint}") from None
    try:
        snap.notes = wal.replay(state_dir, snap, upto)
    except wal.LogError as err:
        raise StateError(
            f"{err}; roll back with `atoll rollback --state-dir {where} --round {read_round(paths[-1])}` "
            "to drop the log after the newest snapshot"
        ) from None
    if upto is not None and snap.round != upto:
        last = f"the log after {paths[-1].name} ends at round {snap.round}"
        raise StateError(f"round {upto} is not kept in {state_dir}: {last}")
    if head is not None and snap.round < head:
        raise StateError(
            f"{state_dir} published round {head} ({HEAD}), but {paths[-1].name} and the log after it reach only "
            f"round {snap.round}: log records are missing (log/ removed?); put them back, or roll back "
            f"explicitly with `atoll rollback --state-dir {where} --round {read_round(paths[-1])}`"
        )
    log_dir = Path(state_dir) / wal.LOG
    if log_dir.exists() and not log_dir.is_dir():
        raise StateError(f"{log_dir} is not a directory (it holds the write-ahead log); move it away")
    departed = read_departed(state_dir)
    if departed is not None:  # written at every leave/evict/re-join: newer than any snapshot
        snap.departed = departed
    return snap


def load_live(state_dir: Path, upto: int | None = None, *, attempts: int = 3, pause: float = 0.5) -> Snapshot | None:
    """:func:`load` of a dir a live coordinator may be writing: a file it prunes (a superseded log
    record, an old snapshot) between our listing and our read fails one attempt, so the
    :class:`StateError` is raised only when it repeats ``attempts`` times."""
    for _ in range(attempts - 1):
        try:
            return load(state_dir, upto)
        except StateError:
            time.sleep(pause)
    return load(state_dir, upto)


def verify(path: Path) -> Snapshot:
    """Read one snapshot and check its integrity and consistency; StateError naming the problem."""
    name = Path(path).name

    def bad(why: str) -> StateError:
        return StateError(f"{name}: {why}")

    try:
        meta = check_file(Path(path), require_meta_digest=False)  # before anything is allocated
    except (IntegrityError, OSError) as err:
        raise bad(str(err)) from None
    if meta.get("format") not in FORMATS:
        raise bad(f"format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta["format"] == FORMAT and META_DIGEST not in meta:
        raise bad("metadata has no checksum")
    try:
        config = RunConfig.from_json(meta["config"])
        round_ = int(meta["round"])
        history = json.loads(meta["history"])
        islands = json.loads(meta["islands"])
        departed = json.loads(meta["departed"])
        buffers = tuple(json.loads(meta["buffers"]))
        shard = tuple(int(x) for x in meta["shard"].split("/"))
        partition = meta["partition"]
        layout = meta["layout_digest"]
        aliases = {k: tuple(v) for k, v in json.loads(meta.get("aliases", "{}")).items()}
        model_card = meta.get("model_card", "")
    except (KeyError, ValueError, TypeError) as err:
        raise bad(f"metadata unreadable ({type(err).__name__}: {err})") from None
    if round_ != read_round(Path(path)):
        raise bad(f"round {round_} in the metadata, {read_round(Path(path))} in the name")
    if len(history) != round_ or any(h.get("round") != i for i, h in enumerate(history)):
        raise bad(f"round {round_} disagrees with its history of {len(history)} rounds")
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise bad(f"not a readable snapshot ({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    params = {k[len("param/") :]: v for k, v in tensors.items() if k.startswith("param/")}
    extra = {k: v for k, v in tensors.items() if not k.startswith("param/")}
    for k, v in params.items():
        m = extra.get(f"momentum/{k}")
        if m is None or m.shape != v.shape:
            raise bad(f"tensor param/{k} has no matching momentum")
        if not bool(torch.isfinite(v).all()):
            raise bad(f"tensor param/{k} holds non-finite values")
    if not params or not set(buffers) <= set(params):
        raise bad("no parameters, or buffers that are not parameters")
    if not set(aliases) <= set(params):
        raise bad("aliases of tensors that are not parameters")
    return Snapshot(
        config, round_, params, extra, islands, history, departed, buffers, shard, partition, layout, aliases,
        model_card=model_card,
    )  # fmt: skip


def list_snapshots(state_dir: Path) -> list[tuple[int, Path, str | None]]:
    """(round, path, None or why it fails verification) for every snapshot, oldest first."""
    out = []
    for p in snapshot_paths(state_dir):
        try:
            verify(p)
            out.append((read_round(p), p, None))
        except StateError as err:
            out.append((read_round(p), p, str(err)))
    return out


def rollback(state_dir: Path, round_: int) -> Path:
    """Make the snapshot of ``round_`` the newest: newer snapshots and updates move to ``discarded/``."""
    state_dir = Path(state_dir)
    target = state_dir / snapshot_name(round_)
    if not target.exists():
        kept = ", ".join(str(read_round(p)) for p in snapshot_paths(state_dir)) or "none"
        raise StateError(f"no snapshot of round {round_} in {state_dir} (kept rounds: {kept})")
    verify(target)
    aside = state_dir / DISCARDED / time.strftime("%Y%m%d-%H%M%S")
    newer = [p for p in snapshot_paths(state_dir) if read_round(p) > round_]
    newer += wal.discard_after(state_dir, round_)
    for p in newer:
        aside.mkdir(parents=True, exist_ok=True)
        shutil.move(str(p), aside / p.name)
    write_head(state_dir, round_)  # the rollback is explicit: the run now stands at round_
    fsync_dir(state_dir)
    return target


# ---- the newest round published ---------------------------------------------------------------
def write_head(state_dir: Path, round_: int) -> None:
    """Record that round ``round_`` is published (θ_round_ may be held by islands): durable."""
    write_atomic(Path(state_dir) / HEAD, [json.dumps({"format": FORMAT, "round": round_}).encode()])


def read_head(state_dir: Path) -> int | None:
    """The newest round the dir records as published; None when it records none (a dir of an older
    coordinator, or a run before its first round)."""
    path = Path(state_dir) / HEAD
    try:
        return int(json.loads(path.read_text())["round"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as err:
        raise StateError(f"{path.name}: unreadable ({err}); it records the newest round published") from None


# ---- departures -----------------------------------------------------------------------------
def write_departed(state_dir: Path, departed: dict[str, str]) -> None:
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(state_dir / MEMBERSHIP, [json.dumps({"departed": departed}, sort_keys=True).encode()])


def read_departed(state_dir: Path) -> dict[str, str] | None:
    path = Path(state_dir) / MEMBERSHIP
    try:
        return dict(json.loads(path.read_text())["departed"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as err:
        raise StateError(f"{path.name}: unreadable ({err}); move it away to forget departures") from None
