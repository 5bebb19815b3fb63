"""How requests and bytes reach the run.

- ``service``: the gRPC servicer, the only layer that knows protobuf and status codes;
- ``bulk_port``: the bulk port, pushes and pulls as plain TCP streams into the same servicer methods;
- ``server``: :class:`CoordinatorServer`, which restores the run and binds the ports;
- ``admin``: /healthz, /metrics, /api/status, the dashboard, the operator's POSTs;
- ``counters``: what the transports count (bytes, refusals), read by admin;
- ``security``: TLS and island tokens; ``corelog``: gRPC core's handshake lines in our words.
"""
