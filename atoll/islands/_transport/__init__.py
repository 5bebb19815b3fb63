"""An island's transport to one coordinator (shard): the client (deadlines, retries, TLS, the bulk port),
the two byte sources it streams over (gRPC, the bulk port's TCP), the one writer and the one reader,
and the probe that tells a setup mistake from an outage. The island's protobuf stays in here and in
the session that speaks the protocol's outcomes."""
