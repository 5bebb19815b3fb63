"""``atoll relay``: a regional aggregator between islands and the coordinator above them.

Islands join a relay exactly as they join a coordinator (the relay serves the same protocol, with
the run's core of :mod:`atoll.coordinator`); each round the relay sums its islands' decoded deltas,
token-weighted, sends their mean up as ONE push that names each island (its tokens and steps, checked
by the root one by one), pulls the round's update once, applies it as an island would, and serves
the same update bytes to its islands. So each byte crosses the wide-area link once per relay, and
every island's θ stays bitwise the root's. Relays chain: a relay's upstream may be another relay. In a
decoupled run a relay forwards once per round of its own, its islands' step scales in its mean.

:mod:`atoll.relay.link` is the relay's side of the coordinator above; :mod:`atoll.relay.main` the daemon.
"""
