"""The run's global model: θ (fp32), its tensor specs and buffers, the outer optimizer and the downlink
error feedback; :meth:`GlobalModel.step` turns a round's summed pseudo-gradients into θ_{r+1}.

One owner of these: the pushes read the specs and codec, the pulls read θ, the core asks for a step
and installs what it published. Nothing else writes them.
"""

from __future__ import annotations

import math

import torch

from atoll.compression import get_codec
from atoll.coordinator.config import RunConfig
from atoll.coordinator.policy import steps
from atoll.coordinator.state.delayed import DelayedNesterov
from atoll.coordinator.state.outer import FiniteTheta, NesterovSGD, outer_step_
from atoll.coordinator.state.workers import SERIAL, TensorWorkers
from atoll.memory import Leases


class GlobalModel:
    def __init__(self, config: RunConfig, workers: TensorWorkers = SERIAL) -> None:
        self.workers = workers
        """The threads the outer step runs on, several tensors at once."""
        self.params: dict[str, torch.Tensor] | None = None
        """θ of the open round; None until θ_0 is published."""
        self.specs: dict[str, tuple[int, ...]] = {}
        """Every tensor's shape (set by θ_0's declaration, before θ_0 itself is published)."""
        self.buffers: frozenset[str] = frozenset()
        """Tensors that are floating-point buffers (averaged, no outer momentum)."""
        self.layout_digest: str | None = None
        self.aliases: dict[str, tuple[str, ...]] = {}
        self.card = ""
        """What the model is (JSON), as the first island that said so declared it at its join: kept
        in the snapshots, written beside an export."""
        """Tied weights: other state_dict names of a tensor (``atoll export`` writes every one)."""
        self.optimizer: NesterovSGD | None = None
        self.downlink_ef: dict[str, torch.Tensor] = {}
        """Downlink error feedback: what the lossy downlink codec did not send yet, per tensor."""
        self._downlink_state: dict[str, dict] = {}
        self._spares: dict[str, bytearray] = {}
        """The last outer update's payloads: the next step's buffers once nobody reads them."""
        self.leases = Leases()
        """Who reads θ's tensors and the update's payloads now (pulls streaming them, the downlink
        keeping the latest update): the next round's sum takes a replaced θ, and the next step the
        last update's payloads, only once nobody does."""
        self.finite = FiniteTheta()
        """The proof that θ stays finite, checked at every step before the round is sealed."""
        self.configure(config)

    def configure(self, config: RunConfig) -> None:
        """Take the run's math (codecs, outer optimizer): at start and when a stored run is restored."""
        self._config = config
        self.uplink = get_codec(config.codec)
        self.downlink = get_codec(config.downlink_codec)

    @property
    def ready(self) -> bool:
        """θ_0 is published: the run has parameters."""
        return self.params is not None

    def update_sizes(self) -> dict[str, int] | None:
        """Each tensor's encoded outer update size, known before the step (None: the codec cannot say)."""
        try:
            return {name: self.downlink.encoded_size(shape) for name, shape in self.specs.items()}
        except NotImplementedError:
            return None

    @property
    def fp32_bytes(self) -> int:
        return 4 * sum(math.prod(s) for s in self.specs.values())

    def define(
        self,
        specs: dict[str, tuple[int, ...]],
        buffers: frozenset[str],
        layout_digest: str | None,
        aliases: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        """Fix the model's tensors (θ_0 arrived): fresh outer optimizer and downlink error feedback."""
        self.specs, self.buffers, self.layout_digest = dict(specs), frozenset(buffers), layout_digest
        self.aliases = dict(aliases or {})
        c = self._config
        shapes = {k: s for k, s in self.specs.items() if k not in self.buffers}
        advance = steps.rule(c.decoupled_step).advance if c.outer_mode == "decoupled" else None
        opts = {"lr": c.outer_lr, "momentum": c.outer_momentum, "nesterov": c.nesterov}
        if advance is not None:
            self.optimizer = DelayedNesterov(shapes, **opts, advance=advance)
        else:
            self.optimizer = NesterovSGD(shapes, **opts)
        self.downlink_ef = {k: torch.zeros(s) for k, s in self.specs.items()} if self.downlink.lossy else {}
        self._downlink_state = {}
        self.finite.reset()

    def restore(self, params, extra: dict[str, torch.Tensor], buffers, layout_digest, aliases=None) -> None:
        """θ, momentum and downlink error feedback from a verified snapshot."""
        specs = {k: tuple(v.shape) for k, v in params.items()}
        self.define(specs, frozenset(buffers), layout_digest or None, aliases)
        self.optimizer.load_state_tensors(extra)
        for name in self.downlink_ef:
            self.downlink_ef[name] = extra[f"downlink_ef/{name}"]
        self.params = params

    def install(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """θ of a published round (or θ_0); returns the θ it replaces (see :meth:`zeros`)."""
        old, self.params = self.params, params
        return old or {}

    def spare_payloads(self) -> list:
        """The last update's payloads kept as the next step's buffers (for an account of the memory)."""
        return list(self._spares.values())

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What a snapshot keeps besides θ: momentum and downlink error feedback, by prefixed name."""
        out = dict(self.optimizer.state_tensors())
        out.update({f"downlink_ef/{k}": v for k, v in self.downlink_ef.items()})
        return out

    def sums(self, reuse: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], set[str]]:
        """Storage for a round's Σ w_i Δ_i, shaped like θ, and the names of its tensors that still hold
        old values (the accumulator counts them as zero: :meth:`RoundAccumulator.reset`). ``reuse``:
        tensors to take as they are instead of new zeroed ones (the θ a publish replaced), each one
        that nobody holds a lease on (no pull streams it, :attr:`leases`): its pages are resident,
        where a new tensor's fault in as the first pushes are added, and it is not zeroed here."""
        out, stale = {}, set()
        for name, shape in self.specs.items():
            t = reuse.pop(name, None) if reuse else None
            if t is not None and tuple(t.shape) == shape and t.dtype == torch.float32 and not self.leases.held(t):
                out[name] = t
                stale.add(name)
            else:
                out[name] = torch.zeros(shape, dtype=torch.float32)
        return out, stale

    def step(
        self,
        sums: dict[str, torch.Tensor],
        weight_total: float,
        robust_grads: dict[str, torch.Tensor] | None = None,
        made=None,
        share: float = 1.0,
    ) -> tuple[dict[str, torch.Tensor], dict[str, bytearray]]:
        """θ_{r+1} and the encoded outer update, from a round's Σ w_i Δ_i (``sums``, which becomes
        θ_{r+1}: no second copy of the model) or its robust aggregate; θ_r and the optimizer's
        momentum advance only here. ``made(name, payload)``: each tensor's payload as soon as it is
        final. See :func:`atoll.coordinator.state.outer.outer_step_`. θ_{r+1} is checked finite
        (:class:`~atoll.coordinator.state.outer.FiniteTheta`: NonFiniteTheta, and nothing is sealed).
        ``share``: the round's share of a full round (decoupled rounds of some islands), which Delayed
        Nesterov counts to know when its momentum advances."""
        delayed = isinstance(self.optimizer, DelayedNesterov)
        if delayed:
            self.optimizer.begin_round(share)
        payloads = outer_step_(
            sums,
            self.params,
            weight_total=weight_total,
            optimizer=self.optimizer,
            buffers=self.buffers,
            downlink=self.downlink,
            downlink_ef=self.downlink_ef,
            downlink_state=self._downlink_state,
            robust_grads=robust_grads,
            spares=self._spares,
            leases=self.leases,
            made=made,
            workers=self.workers,
        )
        if delayed:
            self.optimizer.end_round()
        self._spares = dict(payloads)
        for name, payload in payloads.items():
            self.finite.check(name, self.params[name], sums[name], payload, self.downlink)
        return sums, payloads
