"""The coordinator's write-ahead log: what makes a round durable before it is published, small.

``STATE_DIR/log/round-<r>.safetensors`` is the record of round ``r``: the encoded outer update that
turns θ_r into θ_{r+1} (exactly the bytes islands pull and add), the round's history record, the
membership and the run config after it. It is written and fsynced (temporary file, fsync, rename,
directory fsync) *before* θ_{r+1} is published, so anything an island may hold can be rebuilt:
θ_{r+1} = θ_r + decode(update_r), the very arithmetic the coordinator and the islands did.

The rest of the state is written after the publish, in the background
(:class:`~atoll.coordinator.disk.writer.StateWriter`):

- ``log/optimizer-<R>.safetensors``: the outer optimizer's momentum and the downlink error feedback
  of θ_R, every round (the next outer step waits for it before it changes them);
- ``snapshot-<R>.safetensors`` (:mod:`persistence`): θ_R with all of the above, every
  ``snapshot_every`` rounds.

Restore (:func:`replay`) = the newest verified snapshot + every logged update after it, in order,
each verified by its checksums; the optimizer state is the newest ``optimizer-<R>``. A damaged
record, or a gap in the rounds, is refused (StateError), never skipped. The crash argument is in
docs/design.md ("Durability: a write-ahead log").
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from atoll.compression import codec_of
from atoll.compression.wire import SEALED_DIGEST, WireFormatError
from atoll.coordinator.config import RunConfig
from atoll.coordinator.disk.verified import TRAILERS, IntegrityError, check_file, header_bytes, write_file
from atoll.files import StreamedFile, whole_blocks

LOG = "log"
FORMAT = "atoll-log-1"
RECORD = re.compile(r"round-(\d{8,})\.safetensors")
OPTIMIZER = re.compile(r"optimizer-(\d{8,})\.safetensors")
UPDATE = "update/"

log = logging.getLogger("atoll.coordinator")


class LogError(ValueError):
    """A log file that cannot be trusted; the message names it (persistence turns it into StateError)."""


def record_name(round_: int) -> str:
    return f"round-{round_:08d}.safetensors"


def record_rel(round_: int) -> str:
    """Round ``round_``'s record, relative to the state dir (as an object store names it too)."""
    return f"{LOG}/{record_name(round_)}"


def is_record(rel: str) -> bool:
    """Whether ``rel`` (relative to the state dir, '/'-separated) names a round's log record."""
    head, _, name = rel.rpartition("/")
    return head == LOG and RECORD.fullmatch(name) is not None


def optimizer_name(round_: int) -> str:
    return f"optimizer-{round_:08d}.safetensors"


def canonical(name: str) -> bool:
    """Whether ``name`` is the one name of a log file of its round (``round-00000003.safetensors``, not
    ``round-000000003.safetensors``, which names the same round: a stray a restore must not read)."""
    for pattern, named in ((RECORD, record_name), (OPTIMIZER, optimizer_name)):
        m = pattern.fullmatch(name)
        if m is not None:
            return name == named(int(m.group(1)))
    return False


def strays(state_dir: Path) -> list[str]:
    """Files in the log dir that look like log files but are not one round's canonical name."""
    d = Path(state_dir) / LOG
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if p.name.startswith(("round-", "optimizer-")) and not canonical(p.name))


def _listed(state_dir: Path, pattern: re.Pattern) -> list[tuple[int, Path]]:
    """(round, path) of the canonically named files (a stray is never read: :func:`strays`)."""
    d = Path(state_dir) / LOG
    if not d.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in d.iterdir() if (m := pattern.fullmatch(p.name)) and canonical(p.name))


def records(state_dir: Path) -> list[tuple[int, Path]]:
    """(round, path) of every log record, oldest first."""
    return _listed(state_dir, RECORD)


def optimizer_files(state_dir: Path) -> list[tuple[int, Path]]:
    return _listed(state_dir, OPTIMIZER)


# ---- records --------------------------------------------------------------------------------
@dataclass
class Record:
    round: int
    payloads: dict[str, memoryview]
    """The encoded outer update, per tensor: θ_{round+1} = θ_round + decode(payload)."""
    history: dict
    islands: dict[str, dict]
    config: RunConfig


def append(
    state_dir: Path,
    round_: int,
    payloads: dict,
    history: dict,
    islands: dict,
    config: RunConfig,
    *,
    stream: RecordStream | None = None,
) -> None:
    """Make round ``round_`` durable (before θ_{round_+1} is published): its update (sealed atoll
    payloads: each ends in its own crc32c), record, membership and config, fsynced. ``stream``: the
    record begun while the step made the update (:class:`RecordStream`), finished here if it holds
    exactly these payloads and its header fits; else (and if it fails) the record is written whole."""
    d = Path(state_dir) / LOG
    d.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT,
        "round": str(round_),
        "history": json.dumps(history),
        "islands": json.dumps(islands, sort_keys=True),
        "config": config.to_json(),
    }
    sealed = f"{SEALED_DIGEST:08x}"  # each payload ends in its own crc32c: no second pass over it
    tensors = {UPDATE + k: p for k, p in payloads.items()}
    digests = dict.fromkeys(tensors, sealed)
    # ... which the header names, so it tells this record's content from another's of the same size
    meta[TRAILERS] = json.dumps({k: bytes(memoryview(p).cast("B")[-4:]).hex() for k, p in tensors.items()})
    if stream is not None and stream.finish(round_, tensors, meta, digests):
        return
    write_file(d / record_name(round_), tensors, meta, digests=digests)


STREAM_MIN_BYTES = 16 << 20
"""Updates at least this large have their record written while the step makes them (below, the
whole write is short, and the room set aside for the header would be a large part of the file)."""


def head_hint(sizes: dict[str, int] | None, islands: Callable[[], dict], history: list[dict]) -> int | None:
    """Bytes to set aside for a record's header before its metadata is known (the entries and trailers, twice the
    membership ``islands()``, asked only then, and the last history record ``history[-1:]``, 16 KiB
    for the config and the rest), or None: the record is written whole (sizes unknown, or the update
    is small)."""
    if sizes is None or sum(sizes.values()) < STREAM_MIN_BYTES:
        return None
    names = sum(2 * (len(UPDATE) + len(k)) + 128 for k in sizes)  # its entry, and its trailer (escaped)
    return names + 2 * len(json.dumps(islands())) + 2 * len(json.dumps(history)) + (16 << 10)


class RecordStream:
    """Round ``round_``'s record, begun before its update exists: each payload goes to the file as the
    outer step makes it (:class:`~atoll.files.StreamedFile`: a writer thread, O_DIRECT), so making
    the round durable after the step writes only the header and what is left. The header (history,
    membership, config) is known only then; ``head_hint`` bytes plus room for the entries are set
    aside for it, and a header that does not fit, like any write error, falls back to writing the
    record whole."""

    def __init__(self, state_dir: Path, round_: int, head_hint: int) -> None:
        d = Path(state_dir) / LOG
        d.mkdir(parents=True, exist_ok=True)
        self.round = round_
        self.head_bytes = whole_blocks(head_hint + 8)
        """Bytes set aside for the header, before the update's first payload."""
        self.finished = False
        """:meth:`finish` made it the round's record (the file is this stream's layout)."""
        self._file: StreamedFile | None = None
        self._path = d / record_name(round_)
        self._parts: list[tuple[str, object]] = []
        self._broken = False

    def add(self, name: str, payload) -> None:
        """The next payload of the update (the step's thread), in the order the record lays them out.
        It never fails the step: a file that cannot be opened is a record written whole."""
        if self._broken:
            return
        try:
            if self._file is None:
                self._file = StreamedFile(self._path, self.head_bytes)
        except OSError as err:
            self._broken = True
            log.info("round %d's record will be written whole (%s)", self.round, err)
            return
        self._parts.append((UPDATE + name, payload))
        self._file.append(payload)

    def finish(self, round_: int, tensors: dict, meta: dict, digests: dict) -> bool:
        """Make it the record (True), or leave no file (False: write it whole)."""
        f, self._file = self._file, None
        if f is None:
            return False
        same = round_ == self.round and [(k, id(p)) for k, p in self._parts] == [(k, id(p)) for k, p in tensors.items()]
        self._parts = []
        try:
            if not same:
                raise ValueError("it holds other payloads")
            f.finish(header_bytes(tensors, meta, digests, size=f.head_bytes))
        except (OSError, ValueError) as err:
            f.abandon()
            log.info("round %d's record is written whole (%s)", round_, err)
            return False
        self.finished = True
        return True

    def abandon(self) -> None:
        f, self._file, self._parts = self._file, None, []
        if f is not None:
            f.abandon()


def read(path: Path) -> Record:
    """One record, every checksum verified; LogError naming what is wrong."""
    name = f"{LOG}/{Path(path).name}"
    try:
        meta = check_file(Path(path), require_meta_digest=True)
        if meta.get("format") != FORMAT:
            raise LogError(f"{name}: format {meta.get('format')!r}, expected {FORMAT!r}")
        round_ = int(meta["round"])
        history, islands = json.loads(meta["history"]), json.loads(meta["islands"])
        config = RunConfig.from_json(meta["config"])
        with safe_open(str(path), framework="np") as f:
            payloads = {k[len(UPDATE) :]: memoryview(f.get_tensor(k)) for k in f.keys()}  # noqa: SIM118
    except (IntegrityError, OSError, SafetensorError) as err:
        raise LogError(f"{name}: {err}") from None
    except (KeyError, ValueError, TypeError) as err:
        raise LogError(f"{name}: metadata unreadable ({type(err).__name__}: {err})") from None
    m = RECORD.fullmatch(Path(path).name)
    if m is None or int(m.group(1)) != round_ or history.get("round") != round_:
        raise LogError(f"{name}: holds round {round_} (history record {history.get('round')})")
    return Record(round_, payloads, history, islands, config)


def load_update(state_dir: Path, theta_round: int) -> dict[str, memoryview] | None:
    """The logged update that produced θ_theta_round, or None (not kept, or damaged: a catch-up only
    falls back to the full θ)."""
    path = Path(state_dir) / LOG / record_name(theta_round - 1)
    try:
        return read(path).payloads
    except LogError:
        return None


# ---- replay ---------------------------------------------------------------------------------
def replay(state_dir: Path, snap, upto: int | None = None) -> list[str]:
    """Advance ``snap`` (a verified :class:`~atoll.coordinator.disk.snapshots.Snapshot`, changed in
    place) by every logged round after it (up to θ_upto); returns warnings for the operator. LogError
    when a record is damaged or missing between others, or names other tensors than θ's."""
    notes: list[str] = []
    base = snap.round
    # Optimizer files first: on a live dir each is written after its round's record (with
    # --exact-failover, just before it), so a later listing of the records reaches every one of them
    # (all but that one).
    opt = [(r, p) for r, p in optimizer_files(state_dir) if r > base and (upto is None or r <= upto)]
    for round_, path in records(state_dir):
        if round_ < snap.round or (upto is not None and round_ >= upto):
            continue  # kept for catch-ups (θ is past it), or past what was asked
        if round_ != snap.round:
            raise LogError(
                f"{LOG}/{path.name}: the log has no record of round {snap.round} but holds later ones "
                "(a record was removed by hand?)"
            )
        apply(snap, path)
    if opt and opt[-1][0] == snap.round + 1 and _before_record(opt[-1][1]):
        # --exact-failover put it up before its round's record, which never landed (or not yet): the
        # state of a round never published, not this state's (that round is open again).
        opt.pop()
    if opt and opt[-1][0] > snap.round:
        raise LogError(f"{LOG}/{opt[-1][1].name} is newer than the log's last round ({snap.round})")
    if opt:
        snap.extra = read_optimizer(opt[-1][1], snap.extra)
    have = opt[-1][0] if opt else base
    if have < snap.round:
        notes.append(
            f"the outer optimizer state of round {snap.round} was not on disk (it is written just after a "
            f"publish); continuing with round {have}'s momentum"
        )
    return notes


def apply(snap, path: Path) -> None:
    """Advance ``snap`` (at round r) by the record at ``path`` (round r's), verified first: θ_{r+1} =
    θ_r + decode(u_r), the coordinator's and the islands' very arithmetic. LogError when it is
    damaged or names other tensors than θ's."""
    rec = read(path)
    if rec.round != snap.round:
        raise LogError(f"{LOG}/{Path(path).name}: holds round {rec.round}, the state is at round {snap.round}")
    if set(rec.payloads) != set(snap.params):
        raise LogError(f"{LOG}/{Path(path).name}: its update names other tensors than θ's")
    for name, payload in rec.payloads.items():
        try:
            codec_of(payload).add_decoded_(payload, snap.params[name])
        except WireFormatError as err:
            raise LogError(f"{LOG}/{Path(path).name}: update of {name}: {err}") from None
    snap.history.append(rec.history)
    snap.islands, snap.config, snap.round = rec.islands, rec.config, rec.round + 1


def write_optimizer(
    state_dir: Path, round_: int, tensors: dict[str, torch.Tensor], *, before_record: bool = False
) -> None:
    """The optimizer state of θ_``round_``. ``before_record``: written before the record of round
    ``round_ - 1`` (``--exact-failover``), so said in its metadata: until that record lands, a restore
    sets the file aside (:func:`replay`)."""
    d = Path(state_dir) / LOG
    d.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "round": str(round_), **({"before_record": "1"} if before_record else {})}
    write_file(d / optimizer_name(round_), tensors, meta)


def _before_record(path: Path) -> bool:
    """Whether an optimizer file says it was written before its round's record (a damaged one: no)."""
    try:
        with safe_open(str(path), framework="np") as f:
            return (f.metadata() or {}).get("before_record") == "1"
    except (OSError, SafetensorError):
        return False


def read_optimizer(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Momentum and error feedback of one file, verified, shaped like the snapshot's ``like``."""
    name = f"{LOG}/{Path(path).name}"
    try:
        check_file(Path(path), require_meta_digest=True)
        with safe_open(str(path), framework="pt") as f:
            got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except (IntegrityError, OSError, SafetensorError) as err:
        raise LogError(f"{name}: {err}") from None
    if set(got) != set(like) or any(got[k].shape != like[k].shape for k in like):
        raise LogError(f"{name}: holds other tensors than the snapshot's optimizer state")
    return got


# ---- pruning ----------------------------------------------------------------------------------
def prune(state_dir: Path, *, snapshot_round: int, keep_from: int) -> None:
    """Drop records no longer needed: before the newest snapshot and before ``keep_from`` (the
    oldest a catch-up reads); optimizer files the newest snapshot or a newer file covers."""
    for r, p in records(state_dir):
        if r < min(snapshot_round, keep_from):
            p.unlink(missing_ok=True)
    opts = optimizer_files(state_dir)
    for _, p in opts[:-1]:
        p.unlink(missing_ok=True)
    for r, p in opts[-1:]:
        if r <= snapshot_round:
            p.unlink(missing_ok=True)


def discard_after(state_dir: Path, round_: int) -> list[Path]:
    """Log files a rollback to θ_round_ must set aside: records of rounds >= ``round_`` and
    optimizer files of later rounds."""
    return [p for r, p in records(state_dir) if r >= round_] + [p for r, p in optimizer_files(state_dir) if r > round_]
