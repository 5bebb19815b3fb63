"""Machine-readable reasons on gRPC errors: a google.rpc.ErrorInfo in the status details.

The server attaches ``ErrorInfo(reason=<atoll.v1.Reason name>, domain="atoll.v1")`` to every
refusal; clients act on :func:`reason_of`, never on the message text.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "atoll.v1"


def error_status(code: grpc.StatusCode, reason: str, message: str) -> grpc.Status:
    """A non-OK status carrying ``reason`` (e.g. ``"REASON_NOT_JOINED"``), for ``abort_with_status``."""
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN))
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))


def reason_of(err: grpc.RpcError) -> str | None:
    """The atoll reason of a failed call (``"REASON_..."``), or None when it carries none."""
    try:
        status = rpc_status.from_call(err)
    except (ValueError, AttributeError):  # details that do not match the call's code/message
        return None
    if status is None:
        return None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == DOMAIN:
            return info.reason
    return None
