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


def error_status(code: grpc.StatusCode, reason: Reason, message: str) -> grpc.Status:
    """A non-OK status carrying ``reason``, for ``abort_with_status``."""
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason.value, domain=DOMAIN))
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[detail]))


def reason_of(err: grpc.RpcError) -> Reason | None:
    """The atoll reason of a failed call, or None when it carries none (or one this build does not know)."""
    try:
        status = rpc_status.from_call(err)
    except (ValueError, AttributeError):  # details that do not match the call's code/message
        return None
    if status is None:
        return None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == DOMAIN:
            return parse(info.reason)
    return None
