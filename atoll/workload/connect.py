"""The reference island's link to the coordinator, from its flags (TLS, token, retries, streams)."""

from __future__ import annotations

from atoll.islands import ClientTls, CoordinatorClient, CoordinatorLink, RetryPolicy, WireTransport


def coordinator_link(args, hooks) -> CoordinatorLink:
    """``args``: the island's flags (``IslandArgs``); ``hooks.transport`` wraps each shard's client (the
    harness injects faults there)."""
    retry = RetryPolicy(give_up_seconds=args.give_up_seconds)
    token = args.token or None
    tls = None
    if args.tls_ca:
        tls = ClientTls(
            ca=args.tls_ca,
            cert=args.tls_cert or None,
            key=args.tls_key or None,
            server_name=args.tls_server_name or None,
        )
    streams = args.bulk_streams or None
    return CoordinatorLink(
        args.coordinator,
        run_id=args.run_id,
        island_id=args.island_id,
        retry=retry,
        connect_timeout_seconds=args.connect_timeout_seconds,
        heartbeat_seconds=args.heartbeat_seconds,
        connect=lambda address: hooks.transport(
            WireTransport(CoordinatorClient(address, retry=retry, token=token, tls=tls, bulk_streams=streams))
        ),
    )
