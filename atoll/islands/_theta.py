"""The run's θ at start, per coordinator shard: upload θ_0 when the bootstrap claim is this island's,
else pull the run's θ (uploading θ_0 meanwhile should the claim pass to this island)."""

from __future__ import annotations

from atoll.compression import get_codec
from atoll.islands._messages import Pulled
from atoll.islands._outer_state import OuterState
from atoll.islands._route_table import RouteTable
from atoll.islands._transport.session import Session
from atoll.protos.vocabulary import PushKind, PushOutcome


def bootstrap(session: Session, table: RouteTable, outer: OuterState) -> bool:
    """Upload this rank's owned regions of θ as θ_0 (identity codec); True when they are the run's θ_0
    and this rank holds nothing else of it (it then has θ_0 already: no pull of it back)."""
    ident = get_codec("identity")
    shards = table.shards(session.index)
    owned = table.owned(session.index)
    sizes = [ident.encoded_size(s.sizes) for s in owned]
    header = session.header(PushKind.INIT, 0, owned, sizes, "identity")
    outcome = session.push(header, lambda j: ident.encode(owned[j].local().detach()))  # one tensor at a time
    return outcome is PushOutcome.COMMITTED and len(owned) == len(shards)


def keep_own_theta(session: Session, table: RouteTable, outer: OuterState) -> None:
    """The run's θ_0 is this rank's own upload (:func:`bootstrap` said so): θ_start is the fp32 of its
    θ, exactly what the upload decodes to."""
    session.round = max(session.round, 0)
    outer.start_from_local(table.shards(session.index))


def pull_theta(session: Session, table: RouteTable, outer: OuterState) -> None:
    """Wait for the run's θ (uploading θ_0 if the claim comes to this island) and load it."""
    shards = table.shards(session.index)
    kind, _ = session.pull_until_ready(
        -1, on_entry=outer.applier(shards), bootstrap=lambda: bootstrap(session, table, outer)
    )
    if kind is Pulled.BOOTSTRAPPED:
        keep_own_theta(session, table, outer)
    else:
        outer.load_params(shards, merge=False)


def start(session: Session, table: RouteTable, outer: OuterState, *, claimed: bool) -> None:
    """The run's θ for ``session``'s route: this rank's own upload when the Join gave it the claim
    (``claimed``) and its upload is all of θ_0 it holds, else pulled."""
    if claimed and bootstrap(session, table, outer):
        keep_own_theta(session, table, outer)  # the run's θ_0 is this upload: nothing to pull back
    else:
        pull_theta(session, table, outer)
