"""The DiLoCo wrapper an island drops into its training loop.

    link = CoordinatorLink("host:port", run_id="my-run", island_id="site-a")
    with DiLoCo(model, link, codec="int8") as sync:      # joins; every island starts from the same θ
        for x, y in batches:
            loss = loss_fn(model(x), y); loss.backward(); inner_opt.step(); inner_opt.zero_grad()
            sync.step(tokens=x.numel(), loss=loss.item())   # every H steps: push Δ, pull θ
            if sync.run_complete:
                break
    # leaving the block leaves the run (also on Ctrl-C or an exception)

The link (:mod:`link`) is the connection: transport, identity, membership. This class is the
algorithm: when to sync (:mod:`schedule`), what each rank's shards are (:mod:`shards`) and where
their outer state lives (:mod:`shard_state`), which coordinator shard owns which (:mod:`routes`), the
exchanges in flight (:mod:`exchanges`) and checkpoints (:mod:`resume`).
"""

from __future__ import annotations

import logging
import signal
import threading

import torch
import torch.distributed as dist
from typing_extensions import Unpack

from atoll.compression.staging import pinned_buffer
from atoll.islands import _resume as resume
from atoll.islands import _theta as theta
from atoll.islands._exchanges import Exchanges
from atoll.islands._flight import Flight, RoundStats
from atoll.islands._legacy import LINK_ARGUMENTS, from_deprecated_form
from atoll.islands._link import CoordinatorLink
from atoll.islands._options import DiLoCoKwargs, DiLoCoOptions
from atoll.islands._outer_state import OuterState
from atoll.islands._route_table import RouteTable
from atoll.islands._schedule import Schedule, update_wait_seconds
from atoll.islands._shards import local_shards, model_card, tied_aliases
from atoll.islands._terms import settle
from atoll.islands.errors import Preempted

log = logging.getLogger("atoll.island")


class DiLoCo:
    """DiLoCo for one island (one process, or one rank of a torch.distributed island).

    ``DiLoCo(model, link, **options)``: ``model`` is the module the inner optimizer trains (plain,
    FSDP2 ``fully_shard``, tensor parallel, or both on a 2-D mesh, on any device); ``link`` a
    :class:`~atoll.islands.CoordinatorLink`; ``options`` the fields of
    :class:`~atoll.islands.DiLoCoOptions` (H, codec, overlap, streaming, where outer state
    lives, process groups, a ``before_push`` hook). The constructor does no network I/O;
    :meth:`start` (or entering the ``with`` block) joins the run and loads the global θ into the
    model, and is collective over the island's process group.

    Call :meth:`step` after each inner optimizer step; every H steps it pushes this rank's
    pseudo-gradient Δ = θ_round_start − θ and applies the outer update (or, with ``overlap_steps``,
    τ steps later). In a run whose coordinator has ``--outer-mode decoupled`` the island never waits:
    the update is applied at the first step after it arrived, keeping the progress made since the push
    (θ ← θ_new + (θ − θ_at_push)), and the next push goes out once H steps are counted and the
    previous exchange is done. :meth:`drain` applies exchanges still in flight at the end; :meth:`close`
    leaves the run. :meth:`state_dict` / :meth:`load_state_dict` checkpoint and resume exactly.

    The form ``DiLoCo(model, inner_optimizer, coordinator=..., run_id=..., island_id=...)`` still
    works in this release and warns once (FutureWarning); it builds the link itself.
    """

    def __init__(
        self, model: torch.nn.Module, link: CoordinatorLink | None = None, /, **options: Unpack[DiLoCoKwargs]
    ) -> None:
        if not isinstance(link, CoordinatorLink):
            link, options = from_deprecated_form(link, options)
        misplaced = sorted(LINK_ARGUMENTS & options.keys())
        if misplaced:
            raise TypeError(f"{', '.join(misplaced)}: these belong to the CoordinatorLink, not to DiLoCo")
        self.options = DiLoCoOptions(**options)
        self.model = model
        self.link = link
        group = self.options.process_group
        distributed = dist.is_available() and dist.is_initialized()
        if distributed and not link.named:
            raise ValueError("a multi-rank island needs an explicit island_id shared by its ranks")
        self._rank = dist.get_rank(group) if distributed else 0
        self._num_ranks = dist.get_world_size(group) if distributed else 1
        self.inner_steps = 0
        """Inner steps taken (``step`` calls), across rounds."""
        self.history: list[RoundStats] = []
        """Every finished round's stats, oldest first."""
        self._table: RouteTable | None = None
        self._outer: OuterState | None = None
        self._schedule: Schedule | None = None
        self._exchanges: Exchanges | None = None
        self._resume: dict | None = None
        self._sigterm = None
        """The SIGTERM handler this object replaced while it is started (None: it installed none)."""
        self._preempted = False

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> DiLoCo:
        """Join the run and load the global θ into the model (or, after ``load_state_dict``, resume)."""
        o, link = self.options, self.link
        shards = local_shards(self.model, o.process_group, buffers=o.sync_buffers)
        if not shards:
            raise ValueError("the model has no parameters to sync")
        if self._num_ranks > 1:  # one session id for the island's ranks: rank 0's
            shared = [link.session_id]
            src = dist.get_global_rank(o.process_group, 0) if o.process_group is not None else 0
            dist.broadcast_object_list(shared, src=src, group=o.process_group)
            link.session_id = shared[0]
        card, aliases = model_card(self.model, o.model_card), tied_aliases(self.model)
        table = RouteTable.of(shards, len(link.addresses), streaming=o.streaming)
        outer = OuterState(shards, o)
        requests = [
            table.join_request(i, codec=o.codec, num_ranks=self._num_ranks, aliases=aliases, card=card)
            for i in range(len(table))
        ]
        sessions = link.open(
            self._rank, self._num_ranks, requests, [table.regions(i) for i in range(len(table))], group=o.process_group
        )
        if outer.on_cuda:  # pulled entries land in pinned memory, reused
            for session in sessions:
                session.transport.pin_buffers(pinned_buffer)
        schedule = Schedule(len(table), streaming=o.streaming, sync_every_seconds=o.sync_every_seconds)
        exchanges = Exchanges(
            table,
            outer,
            link,
            schedule,
            overlap=bool(o.overlap_steps),
            align=o.align_pushes,
            group=o.process_group,
            token_group=o.token_group,
        )
        try:
            joined = link.join()
            link.terms = settle(o, sessions, joined)
            exchanges.overlap = exchanges.overlap or link.terms.decoupled  # the run's mode, known from the join
            if self._resume is not None:
                done = resume.resume(
                    self._resume,
                    table,
                    outer,
                    sessions,
                    exchanges,
                    joined,
                    lambda: all(s.run_complete for s in sessions),
                )
                self.history.extend(done)
            else:
                for s, resp in zip(sessions, joined, strict=True):
                    theta.start(s, table, outer, claimed=resp.bootstrap)
        except BaseException:
            link.close(leave=False)  # a failed start must not keep the island alive on the coordinator
            raise
        self._table, self._outer, self._schedule, self._exchanges = table, outer, schedule, exchanges
        self._watch_sigterm()
        schedule.begin(link.terms.sync_every)
        if self._resume is not None:
            saved = self._resume.get("routes", self._resume.get("links"))  # "links": an earlier release
            for count, sd in zip(schedule.routes, saved, strict=True):
                count.load_state_dict(sd)
            self._resume = None
        return self

    def __enter__(self) -> DiLoCo:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, leave: bool = True) -> None:
        """Leave the run. An exchange still in flight is abandoned (call ``drain()`` first to wait
        for it and apply it)."""
        if self._table is None:
            return
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None
        self.link.stopping.set()
        if self._exchanges.in_flight():
            log.warning("%s: closing with round %d's exchange in flight; abandoned", self.island_id, self.round)
            self._exchanges.abandon()
        self.link.close(leave)
        self._table = self._outer = None

    # ---- what the island is and where it stands -------------------------------------------------
    @property
    def island_id(self) -> str:
        return self.link.island_id

    @property
    def run_id(self) -> str:
        return self.link.run_id

    @property
    def sync_every(self) -> int:
        """H: inner steps per round (the run's, once started)."""
        return self._terms.sync_every if self._terms else (self.options.sync_every or 0)

    @property
    def decoupled(self) -> bool:
        """The run's outer mode is decoupled (``atoll coordinator --outer-mode decoupled``; known once
        started): step() never waits for an outer step, and the model holds local progress on top of
        the global θ."""
        return bool(self._terms and self._terms.decoupled)

    @property
    def codec(self):
        """The codec this island pushes with (the run's, once started)."""
        return self._terms.codec if self._terms else None

    @property
    def round(self) -> int:
        """The round this island works on (the oldest over coordinator shards; -1 before start)."""
        return min((s.round for s in self._sessions()), default=-1)

    @property
    def rounds_pushed(self) -> int:
        """Rounds pushed since start() (the fewest over coordinator shards / fragments)."""
        return min((c.pushed for c in self._schedule.routes), default=0) if self._schedule else 0

    @property
    def round_steps(self) -> int:
        """Inner steps taken so far in the current round (of the oldest shard / fragment)."""
        sessions = self._sessions()
        if not sessions:
            return 0
        oldest = min(range(len(sessions)), key=lambda i: sessions[i].round)
        return self._schedule.routes[oldest].steps

    @property
    def exchanging(self) -> bool:
        """An exchange is in flight: pushed, its update not applied yet (overlap, decoupled)."""
        return bool(self._exchanges and self._exchanges.in_flight())

    @property
    def run_complete(self) -> bool:
        """The run reached its total rounds (``atoll coordinator --total-rounds``) and this island holds
        the final θ: stop training. ``step()`` does nothing more once it is set."""
        sessions = self._sessions()
        return bool(sessions) and all(s.run_complete for s in sessions) and not self._exchanges.in_flight()

    def _sessions(self) -> list:
        return self.link.sessions if self._table else []

    @property
    def _terms(self):
        """The run's terms, once started (the link keeps them)."""
        return self.link.terms if self._table else None

    def _device(self) -> torch.device:
        return self._table.routes[0][0].local().device

    # ---- SIGTERM ---------------------------------------------------------------------------------
    def _watch_sigterm(self) -> None:
        if not self.options.handle_sigterm or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the program handles SIGTERM itself
        self._sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        """Only flags: the island stops at a safe point (the end of an inner step), and a wait for the
        outer step gives up at its next poll."""
        log.warning("%s: SIGTERM: stopping at the end of this inner step, then leaving the run", self.island_id)
        self._preempted = True
        self.link.preempt()

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of the island (one MAX all-reduce when it has several)."""
        if self._num_ranks == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.options.process_group)
        return bool(t.item())

    def _check_preempted(self) -> None:
        """Raise Preempted at a safe point once SIGTERM arrived (on any rank of the island)."""
        if self._any_rank(self._preempted):  # the ranks stop at the same step, or their collectives hang
            self._preempted = True
            self.link.preempt()
            raise Preempted()

    # ---- training loop -------------------------------------------------------------------------
    def step(self, tokens: int = 0, loss: float | None = None) -> RoundStats | None:
        """Call after each inner optimizer step. Returns a round's stats when one completed (its
        outer update was applied: at the sync, or ``overlap_steps`` later when overlapping).

        ``tokens``: tokens this rank processed in the step; the island's count is their sum over
        ``token_group`` (all ranks, by default), taken once per sync. ``loss``: this step's loss.
        """
        if self._table is None:
            raise RuntimeError("DiLoCo.start() was not called")
        self.inner_steps += 1
        self._schedule.count(tokens, loss)
        done = None
        decoupled = self._terms.decoupled
        for flight in self._exchanges.in_flight():
            if decoupled:  # applied once it arrived (on every rank), never waited for
                if not self._any_rank(flight.thread is not None and flight.thread.is_alive()):
                    done = self._finish(flight)
            elif self.inner_steps - flight.pushed_at >= self.options.overlap_steps:
                done = self._finish(flight)
        if not self.run_complete:
            due = self._due_routes()  # a route whose exchange is still out is not due: training goes on
            if due:
                flight = self._begin(due)
                if not self.options.overlap_steps and not decoupled:
                    done = self._finish(flight)
                elif decoupled and self.options.update_wait > 0:
                    done = self._wait_briefly(flight) or done
        if self._sigterm is not None:
            self._check_preempted()
        return done

    def _wait_briefly(self, flight: Flight) -> RoundStats | None:
        """Decoupled: wait for the update of the push just made, up to ``update_wait`` times the compute
        time its steps took, while the last exchange came back within 1.5x that (:func:`update_wait_seconds`),
        and apply it if it came, so that no step is taken on the θ it replaces; else train on. The wait
        counts as blocked, not as compute."""
        compute = max(h.compute_seconds for _, h, _ in flight.pushes)
        last = self.history[-1].exchange_seconds if self.history else None
        wait = update_wait_seconds(self.options.update_wait, compute, last)
        clock = self._schedule.clock
        started = clock()
        if flight.thread is not None and wait > 0:
            flight.thread.join(wait)
        self._schedule.was_blocked(clock() - started)
        if self._any_rank(flight.thread is not None and flight.thread.is_alive()):
            return None
        return self._finish(flight)

    def _due_routes(self) -> list[int]:
        sessions, busy = self.link.sessions, set(self._exchanges.by_route)
        if self.options.sync_every_seconds is None:
            due = [i for i in self._schedule.due_by_steps(busy) if not sessions[i].run_complete]
            return sorted(set(due) | set(self._behind(busy))) if self._terms.decoupled else due
        if not self._any_rank(self._schedule.budget_spent()):  # the island's ranks agree on when to sync
            return []
        if self._terms.decoupled:  # the budget is up with the last one still out: train on
            return [] if busy else list(range(len(sessions)))
        for flight in self._exchanges.in_flight():  # the budget is up with the last one still out
            self._finish(flight)
        return list(range(len(sessions)))

    def _behind(self, busy: set[int]) -> list[int]:
        """Decoupled: the idle routes whose θ the run has moved ``push_behind`` rounds past, so a push at
        H steps would come too stale to fold. They push now with the steps they have: an island slower
        than the others takes fewer inner steps per round, as DyLU (Liu et al. 2024) sets them from
        the workers' speeds, here from the rounds the island sees go by. The island's ranks agree."""
        sessions, counts = self.link.sessions, self._schedule.routes
        flags = [
            i not in busy
            and counts[i].steps > 0
            and not sessions[i].run_complete
            and sessions[i].latest_round - sessions[i].round >= self._terms.push_behind
            for i in range(len(sessions))
        ]
        if self._num_ranks > 1:
            t = torch.tensor(flags, dtype=torch.float32, device=self._device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.options.process_group)
            flags = [bool(x) for x in t.tolist()]
        return [i for i, behind in enumerate(flags) if behind]

    def sync(self) -> RoundStats:
        """Push this round's pseudo-gradient to every shard, wait for the outer step and apply it
        (whatever ``overlap_steps`` says; an exchange already in flight is finished first)."""
        self.drain()
        return self._finish(self._begin(list(range(len(self.link.sessions)))))

    def last_round(self) -> None:
        """The exchange this island starts next is its last (``atoll island --rounds``): should the
        coordinator report that its round can never close (fewer islands committed or live than the
        quorum: the others left), the wait for its outer step raises
        :class:`~atoll.islands.errors.QuorumGone` instead of lasting until islands come back."""
        for s in self._sessions():
            s.last = True

    def drain(self) -> list[RoundStats]:
        """Wait for the exchanges in flight and apply them (at the end of training)."""
        return [self._finish(f) for f in self._exchanges.in_flight()]

    def _begin(self, indices: list[int]) -> Flight:
        hook = self.options.before_push
        return self._exchanges.begin(indices, self.inner_steps, None if hook is None else lambda: hook(self))

    def _finish(self, flight: Flight) -> RoundStats:
        if self._preempted:
            if flight.thread is not None:  # the background wait gives up at its next poll
                flight.thread.join()
                flight.thread = None
            if flight.error is not None:
                raise Preempted()  # the wait for the outer step gave up: the flight stays, for a checkpoint
        stats = self._exchanges.finish(flight, lambda: self.run_complete)
        self._schedule.was_blocked(stats.sync_seconds)
        self.history.append(stats)
        return stats

    def global_params(self) -> dict[str, torch.Tensor]:
        """This rank's regions of θ for the current round, as received (fp32), keyed by name. With
        overlap, the round's update is in it once it arrived (the exchange's thread applies it before
        the merge step)."""
        return {s.name: self._outer.of(s).start for s in self._table.all_shards()}

    def pseudo_gradient(self) -> dict[tuple, torch.Tensor]:
        """This rank's pseudo-gradient so far, θ_round_start − θ, per region it pushes (name, offsets,
        sizes; a region several ranks hold is pushed by the lowest of them), on the parameters'
        device: for inspection, e.g. in ``before_push``."""
        return {s.key: self._outer.of(s).delta() for s in self._table.all_shards() if s.owned}

    # ---- checkpoints (atoll.islands._resume) ------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's DiLoCo state, for a checkpoint of the island: rounds, steps and tokens into
        the round, round-start θ, error-feedback residuals and codec state, and an exchange that was
        pushed but not applied yet (its payloads, so a resumed island re-pushes the same bytes).
        Tensors are CPU copies; save it with the model and inner optimizer (torch.save, or one entry
        per rank beside a torch.distributed.checkpoint of the model)."""
        if self._table is None:
            raise RuntimeError("state_dict() needs a started DiLoCo")
        return resume.state_dict(
            self._identity(), self.inner_steps, self._outer, self.link.sessions, self._schedule, self._exchanges
        )

    def load_state_dict(self, sd: dict) -> None:
        """Restore a state from :meth:`state_dict` before ``start()``: start() then rejoins (with the
        same session, so a restarted process is not taken for a second one), re-pushes an exchange that
        was in flight (idempotent) and catches up by exact deltas if the run moved on."""
        if self._table is not None:
            raise RuntimeError("load_state_dict() goes before start()")
        resume.check(self._identity(), sd)
        self.link.session_id = sd["session_id"]
        self.inner_steps = int(sd["inner_steps"])
        self._resume = sd

    def _identity(self) -> resume.Who:
        return resume.Who(self.run_id, self.island_id, self.link.session_id, self._rank, self._num_ranks)
