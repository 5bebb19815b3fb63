"""Loading an island checkpoint without running code from it.

torch.distributed.checkpoint reads a checkpoint's ``.metadata`` with ``pickle.load`` and every value
that is not a tensor (the optimizer's param groups) with ``torch.load(weights_only=False)``: anyone who
can write the checkpoint's dir, or its prefix in an object store, could run code on the island. Here the
metadata is unpickled with an allowlist of the classes DCP's own metadata is made of (its dataclasses,
``torch.Size``, dtypes, layouts, paths), and every other value through ``torch.load(weights_only=True)``
(tensors and plain Python values only). :func:`verify` checks all of it before DCP reads a byte (DCP
would wrap a refusal from inside its load in an error of its own, and log a traceback); the reader and
planner keep the rule inside the load too. A checkpoint holding anything else is refused with one line.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

from atoll.errors import UserError

ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpoint(UserError):
    """A checkpoint that holds something other than tensors, plain values and DCP's own metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"its metadata names {module}.{name}, which a checkpoint's metadata never holds")


def read_metadata(path: Path):
    """A checkpoint's ``.metadata``, unpickled with the allowlist; UnsafeCheckpoint otherwise."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except UnsafeCheckpoint:
        raise
    except Exception as err:  # (truncated, garbage: any unpickling error)
        raise UnsafeCheckpoint(f"its metadata does not read ({type(err).__name__}: {err})") from None


def _plain(data, what: str):
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:
        raise UnsafeCheckpoint(
            f"its value {what} is not tensors and plain values ({str(err).splitlines()[0]})"
        ) from None


def verify(path: Path) -> None:
    """Check the checkpoint in dir ``path`` before DCP reads it: its metadata unpickles with the
    allowlist, names only files of that dir, and every value that is not a tensor loads as tensors and
    plain values. UnsafeCheckpoint (one line) otherwise; nothing of it runs."""
    path = Path(path)
    metadata = read_metadata(path / ".metadata")
    storage = getattr(metadata, "storage_data", None) or {}
    for index, info in storage.items():
        name = str(getattr(info, "relative_path", ""))
        if not name or Path(name).name != name or name.startswith("."):
            raise UnsafeCheckpoint(f"its metadata names the file {name!r}, outside the checkpoint's dir")
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if getattr(info, "transform_descriptors", None):  # (not written by atoll: DCP's planner checks it)
            continue
        with open(path / name, "rb") as f:
            f.seek(int(info.offset))
            _plain(f.read(int(info.length)), index.fqn)


class SafeReader(FileSystemReader):
    """DCP's file reader whose ``.metadata`` is unpickled with the allowlist."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner whose values that are not tensors load as tensors and plain values only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as err:
            fqn = read_item.dest_index.fqn
            raise UnsafeCheckpoint(
                f"its value {fqn} is not tensors and plain values ({str(err).splitlines()[0]})"
            ) from None
        plain = io.BytesIO()  # what DCP's own load_bytes reads: our serialisation of a checked value
        torch.save(obj, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)
