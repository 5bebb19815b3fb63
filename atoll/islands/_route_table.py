"""Which of an island's local shards each coordinator shard owns: a pure table, built once.

A *route* is the local shards one coordinator shard owns, indexed as the link's sessions (route i goes
to session i); a *local shard* is a rank's region of a tensor. A tensor goes to the shard the hash of
its name picks, or, for Streaming DiLoCo, to the contiguous fragment of the model it falls in
(:mod:`atoll.sharding`): the coordinator computes the same from the names, so no shard map is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from atoll.compression import available_codecs
from atoll.islands._messages import JoinRequest, TensorDecl, TensorRegion
from atoll.islands._shards import LocalShard
from atoll.sharding import layer_partition, layout_digest, shard_of


@dataclass(frozen=True)
class RouteTable:
    routes: tuple[tuple[LocalShard, ...], ...]
    """Route i: the local shards coordinator shard i owns, in model order."""
    streaming: bool = False
    """Routes are Streaming DiLoCo's contiguous fragments (else: the hash of each tensor's name)."""
    digest: str = ""
    """Streaming: the digest of the model's layout, sent at Join (islands that would cut different
    fragments are refused); "" otherwise."""

    @classmethod
    def of(cls, shards: list[LocalShard], num_routes: int, *, streaming: bool) -> RouteTable:
        """Route ``shards`` to ``num_routes`` coordinator shards; ValueError if one would own nothing."""
        digest = ""
        if streaming:
            layout = [(s.name, tuple(s.tensor.shape)) for s in shards]
            route_of = layer_partition([(name, math.prod(shape)) for name, shape in layout], num_routes)
            digest = layout_digest(layout)
        else:
            route_of = {s.name: shard_of(s.name, num_routes) for s in shards}
        routes = tuple(tuple(s for s in shards if route_of[s.name] == i) for i in range(num_routes))
        empty = [i for i, mine in enumerate(routes) if not mine]
        if empty:
            raise ValueError(
                f"coordinator shards {empty} of {num_routes} own none of the model's tensors; use fewer shards"
            )
        return cls(routes, streaming, digest)

    def __len__(self) -> int:
        return len(self.routes)

    def shards(self, i: int) -> tuple[LocalShard, ...]:
        return self.routes[i]

    def all_shards(self) -> list[LocalShard]:
        return [s for route in self.routes for s in route]

    def owned(self, i: int) -> list[LocalShard]:
        """Route i's shards this rank pushes (a region several ranks hold: the lowest of them)."""
        return [s for s in self.routes[i] if s.owned]

    def regions(self, i: int) -> list[TensorRegion]:
        """What this rank pulls from coordinator shard i."""
        return [
            TensorRegion(s.name) if s.is_full else TensorRegion(s.name, tuple(s.offsets), tuple(s.sizes))
            for s in self.routes[i]
        ]

    def join_request(
        self,
        i: int,
        *,
        codec: str | None,
        num_ranks: int,
        aliases: dict[str, tuple[str, ...]],
        card: str,
    ) -> Callable[[], JoinRequest]:
        """Builds coordinator shard i's JoinRequest: its tensors, the codecs offered (``codec``, a spec
        with parameters travelling whole, or every codec), the layout; ``aliases``: tied weights' other
        names; ``card``: the model card (JSON)."""
        offered = (codec,) if codec else tuple(available_codecs())

        def build() -> JoinRequest:
            tensors: dict[str, TensorDecl] = {}
            for s in self.routes[i]:
                tensors.setdefault(
                    s.name,
                    TensorDecl(
                        s.name,
                        tuple(s.tensor.shape),
                        s.tensor.dtype,
                        s.kind,
                        aliases=tuple(aliases.get(s.name, ())),
                    ),
                )
            return JoinRequest(
                codecs=offered,
                tensors=tuple(tensors.values()),
                num_ranks=num_ranks,
                shard_index=i,
                num_shards=len(self.routes),
                partition="layers" if self.streaming else "hash",
                layout_digest=self.digest,
                model_card=card,
            )

        return build
