"""The reference island's options (``atoll island``'s flags, one field each, its docstring the help),
checked where they are made."""

from __future__ import annotations

import math
from dataclasses import dataclass

from atoll.models import PRESETS
from atoll.workload.inner import OPTIMIZERS
from atoll.workload.parallel import MODES


@dataclass(frozen=True, kw_only=True)
class IslandArgs:
    coordinator: str
    """host:port of the coordinator (its fragments comma-separated with --streaming); standbys after |
    (coord-a:7070|coord-b:7070), tried in turn while it is unreachable."""
    island_id: str
    """This island's name in the run (each island process its own)."""
    run_id: str = "atoll"
    """The run to join (must match the coordinator's --run-id)."""
    rounds: int = 0
    """Rounds of the run this process trains before it leaves, from the round it starts at (0: until the
    run is complete): it stops once it holds θ of that round plus N, or after N pushes, whichever comes
    first (a round it missed, catching up, counts), and its last round never waits for a quorum that
    is gone."""
    codec: str = ""
    """Codec to insist on: a name takes the run's parameters, a spec must match them exactly (empty: the run's)."""
    data: str = ""
    """Training data: a .bin file of uint16 token ids (nanoGPT's train.bin) or a UTF-8 text file
    (bytes); empty: the bundled text, char-level."""
    vocab_size: int = 0
    """Vocabulary of a .bin token file (0: from PATH.json or meta.json beside it, {"vocab_size": N})."""
    model: str = "tiny"
    """Model size preset: tiny, gpt-small, gpt-125m, gpt-350m, gpt-760m or gpt-1.3b."""
    n_layer: int = 0
    """Transformer blocks (0: the preset's)."""
    n_embd: int = 0
    """Embedding width (0: the preset's)."""
    n_head: int = 0
    """Attention heads (0: the preset's)."""
    block_size: int = 0
    """Context length in tokens (0: the preset's)."""
    batch_size: int = 16
    """Sequences per inner step for the whole island (split over its data-parallel ranks)."""
    inner_lr: float = 1e-3
    """Learning rate of the inner optimizer (Muon's matched to AdamW's update size)."""
    inner_optimizer: str = "adamw"
    """adamw, or muon: torch.optim.Muon on the 2-D weights inside the blocks, AdamW on the rest (torch
    2.9 or later; each matrix whole on a rank: --parallel none)."""
    lr_warmup_steps: int = 0
    """Linear warmup of the inner learning rate over this many inner steps (0: none)."""
    seed: int = 0
    """Model init seed (θ_0 comes from the bootstrap island, so only its seed matters)."""
    data_seed: int = -1
    """Seed of this island's batch sampler (-1: a hash of island_id)."""
    threads: int = 1
    """torch intra-op threads on the CPU (islands sharing a small machine should not oversubscribe it)."""
    eval_every_round: bool = True
    """Evaluate the held-out loss after every round."""
    give_up_seconds: float = 600.0
    """Retry an unreachable coordinator for this long during training before failing (seconds)."""
    connect_timeout_seconds: float = 120.0
    """How long to try reaching the coordinator at start (seconds)."""
    nproc: int = 1
    """Ranks of this island; above 1, the island re-launches itself under torch.distributed.run."""
    parallel: str = "none"
    """How the ranks share the model: none, fsdp, tp or fsdp+tp."""
    outer_state: str = "host"
    """Where DiLoCo keeps its round-start θ and residuals: host (pinned on CUDA) or device."""
    checkpoint_dir: str = ""
    """Save the island here at each push (in the background) and resume from it at start."""
    digest: bool = True
    """Report a sha256 of the full θ after every pull (gathers θ: verification only)."""
    dump_dir: str = ""
    """If set, every rank writes the Δ shards it pushed in round 0 here (for tests)."""
    sync_every_seconds: float = 0.0
    """If > 0, sync on this time budget (seconds) instead of every H steps. H itself is the run's: the
    coordinator decides it (atoll coordinator --sync-every)."""
    heartbeat_seconds: float = 5.0
    """Seconds between lease renewals."""
    staged_copies: bool = True
    """On a CUDA device, payloads cross in one copy each way on a side stream, through pinned buffers
    (--no-staged-copies: piece by piece into fresh host memory, as before)."""
    overlap_steps: int = 0
    """If > 0, keep training while the outer exchange is in flight; apply it this many steps later."""
    align_pushes: bool = True
    """Decoupled runs: push when the others do (H/2 to 2H steps, from where the coordinator says the
    last pushes landed); --no-align-pushes: every H steps."""
    update_wait: float = 0.2
    """Decoupled runs: after a push, wait for its update up to this many times the compute time of the
    push's steps, then train on without it (0: never wait)."""
    streaming: bool = False
    """Streaming DiLoCo: the coordinator's fragments (--fragments P) sync on staggered schedules."""
    progress: str = "auto"
    """auto (a progress line on a terminal, JSON lines otherwise), terminal or json."""
    progress_seconds: float = 30.0
    """Without a terminal: a progress line (step, loss, tokens/s, time to the next sync) at most this
    often between syncs (seconds; 0: none)."""
    token: str = ""
    """This island's bearer token (when the coordinator runs with --island-tokens)."""
    tls_ca: str = ""
    """CA of the coordinator's certificate: connect over TLS."""
    tls_cert: str = ""
    """This island's certificate (mutual TLS)."""
    tls_key: str = ""
    """This island's private key (mutual TLS)."""
    tls_server_name: str = ""
    """Name expected in the coordinator's certificate, if not the address's host."""
    bulk_streams: int = 0
    """TCP connections each push and pull is striped over on the coordinator's bulk port (0: from the
    measured round trip: one on a LAN, one per 20 ms beyond, at most 8)."""

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {self.rounds}")
        if self.nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {self.nproc}")
        if not 0 <= self.bulk_streams <= 16:
            raise ValueError(f"bulk_streams must be in [0, 16] (0: from the round trip), got {self.bulk_streams}")
        if self.parallel not in MODES:
            raise ValueError(f"parallel must be one of {MODES}, got {self.parallel!r}")
        if self.model not in PRESETS:
            raise ValueError(f"model must be one of {', '.join(PRESETS)}, got {self.model!r}")
        if not (math.isfinite(self.progress_seconds) and self.progress_seconds >= 0):
            raise ValueError(f"progress_seconds must be a finite number >= 0, got {self.progress_seconds}")
        if self.inner_optimizer not in OPTIMIZERS:
            raise ValueError(f"inner_optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.inner_optimizer!r}")
        if self.inner_optimizer == "muon" and self.parallel != "none":
            whole = "inner_optimizer muon needs each weight matrix whole on a rank"
            raise ValueError(f"{whole}, not --parallel {self.parallel}")
        if self.progress not in ("auto", "terminal", "json"):
            raise ValueError(f"progress must be auto, terminal or json, got {self.progress!r}")
        if min(self.n_layer, self.n_embd, self.n_head, self.block_size, self.vocab_size, self.lr_warmup_steps) < 0:
            raise ValueError("model sizes, vocab_size and lr_warmup_steps must be >= 0")
