"""Machine-readable reasons on gRPC errors: a google.rpc.ErrorInfo in the status details.

The server attaches ``ErrorInfo(reason=<atoll.v1.Reason name>, domain="atoll.v1")`` to every
refusal; clients act on :func:`reason_of` (a :class:`~atoll.protos.reasons.Reason`), never on the
message text.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from atoll.protos.reasons import Reason, parse

DOMAIN = "atoll.v1"


CHAIN = "relay_chain"
"""The ErrorInfo metadata key of a relay's refusal: the relays it waits on, comma-separated, itself first."""


def error_status(code: grpc.StatusCode, reason: Reason, message: str, chain: tuple[str, ...] = ()) -> grpc.Status:
    """A non-OK status carrying ``reason`` (and, from a relay, its ``chain``), for ``abort_with_status``."""
    detail = any_pb2.Any()
    info = error_details_pb2.ErrorInfo(reason=reason.value, domain=DOMAIN)
    if chain:
        info.metadata[CHAIN] = ",".join(chain)
    detail.Pack(info)
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))


def _info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    try:
        status = rpc_status.from_call(err)
    except (ValueError, AttributeError):  # details that do not match the call's code/message
        return None
    if status is None:
        return None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == DOMAIN:
            return info
    return None


def reason_of(err: grpc.RpcError) -> Reason | None:
    """The atoll reason of a failed call, or None when it carries none (or one this build does not know)."""
    info = _info(err)
    return None if info is None else parse(info.reason)


def chain_of(err: grpc.RpcError) -> tuple[str, ...]:
    """The relay chain a relay's refusal carries (empty: none)."""
    info = _info(err)
    text = "" if info is None else info.metadata.get(CHAIN, "")
    return tuple(text.split(",")) if text else ()
