"""The islands' calls on the run: join, heartbeat, leave, and an operator's evict. Each is checked
against the run and acts on the owners (membership, accumulator, model, ledger); it holds no state
of its own, as :mod:`pushes` and :mod:`pulls` do not."""

from __future__ import annotations

import logging
from pathlib import Path

from atoll.coordinator.disk import snapshots
from atoll.coordinator.errors import Reason, refuse
from atoll.coordinator.messages import Admission, IslandCall, JoinRequest
from atoll.coordinator.run import checks
from atoll.coordinator.run.options import PlacementOptions
from atoll.coordinator.run.owners import Owners

log = logging.getLogger("atoll.coordinator")


class Islands:
    def __init__(self, owners: Owners, placement: PlacementOptions, state_dir: Path, name: str = "") -> None:
        """``name``: prefix of the log lines (a fragment's)."""
        self._config, self.placement, self.state_dir, self.name = owners.config, placement, state_dir, name
        self.membership, self.accumulator = owners.membership, owners.accumulator
        self.model, self.ledger = owners.model, owners.ledger

    def _complete(self) -> bool:
        return self.ledger.complete(self._config().total_rounds)

    def join(self, req: JoinRequest, chain: tuple[str, ...] = ()) -> Admission:
        """``chain``: this coordinator's relay chain (itself first; empty at the root)."""
        config = self._config()
        checks.run_id(config, req.run_id)
        if req.relay and req.island_id in chain:
            raise refuse(
                Reason.RELAY_LOOP,
                f"relay {req.island_id!r} is already above this one ({' -> '.join(chain)}): its upstream would be "
                "its own downstream",
            )
        num_ranks = checks.join(req, self.placement.shard, self.placement.partition, config)
        specs = checks.tensors(req.tensors)
        checks.aliases_of(req.tensors)
        model = self.model
        if model.ready:
            if self.placement.partition == "layers" and req.layout_digest != model.layout_digest:
                raise refuse(
                    Reason.MODEL_MISMATCH,
                    f"island's model layout {req.layout_digest} differs from the run's {model.layout_digest}: "
                    "islands would cut different fragments",
                )
            checks.same_model(model.specs, specs, model.buffers, checks.buffers_of(req.tensors))
        model.card = model.card or req.model_card  # (the first island that says what the model is)
        was_departed = req.island_id in self.membership.departed
        _, new = self.membership.join(
            req.island_id,
            num_ranks=num_ranks,
            session_id=req.session_id,
            round_=self.ledger.round,
            tensors=req.tensors,
            layout_digest=req.layout_digest,
            relay=req.relay,
        )
        if new:
            self.accumulator.drop_island(req.island_id)
        if not model.ready:
            self.accumulator.size_budget(specs, self.name)
        if was_departed:
            self._write_departed()
        bootstrap = not model.ready and self.ledger.sealed is None and self.membership.claim_bootstrap(req.island_id)
        log.info(
            "%sisland %s joined (%d ranks) at round %d%s",
            self.name,
            req.island_id,
            num_ranks,
            self.ledger.round,
            ", bootstrapping θ" if bootstrap else "",
        )
        self.ledger.poke.set()
        return Admission(
            config=config,
            round=self.ledger.round,
            bootstrap=bootstrap,
            codec=config.codec,
            run_complete=self._complete(),
            relay_chain=chain,
        )

    def heartbeat(self, call: IslandCall) -> tuple[int, float, bool]:
        """(open round, lease seconds, run complete)."""
        checks.run_id(self._config(), call.run_id)
        self.membership.touch(call.island_id, call.session_id)
        return self.ledger.round, self._config().lease_seconds, self._complete()

    def leave(self, call: IslandCall) -> None:
        checks.run_id(self._config(), call.run_id)
        self.membership.touch(call.island_id, call.session_id)
        self.membership.leave(call.island_id)
        self.accumulator.drop_island(call.island_id)
        self._write_departed()
        log.info("%sisland %s left at round %d", self.name, call.island_id, self.ledger.round)
        self.ledger.poke.set()

    def evict(self, island_id: str) -> None:
        """Remove an island for good (operator): it no longer counts, its joins are refused."""
        self.membership.evict(island_id)  # KeyError for an unknown island
        self.accumulator.drop_island(island_id)
        self._write_departed()
        log.warning("%sisland %s evicted by an operator at round %d", self.name, island_id, self.ledger.round)
        self.ledger.poke.set()

    def _write_departed(self) -> None:
        if self.model.ready:  # before θ_0 there is no run to protect
            snapshots.write_departed(self.state_dir, self.membership.departed)
