"""The reference island: trains the tiny GPT on the bundled text under DiLoCo.

Prints one JSON object per line on stdout (``{"event": "round", ...}``) so the harness and the
demo can follow it; logs go to stderr.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from atoll.data import CharDataset
from atoll.harness.faults import IslandFaults
from atoll.islands import DiLoCo
from atoll.islands.client import ClientTls, RetryPolicy
from atoll.islands.parallel import MODES, full_tensor, parallelize
from atoll.memory import tune_for_bulk_buffers
from atoll.models import GPTConfig, TinyGPT


@dataclass(frozen=True, kw_only=True)
class IslandArgs:
    coordinator: str
    """host:port of the coordinator."""
    island_id: str
    run_id: str = "atoll"
    rounds: int = 5
    """Rounds to train before leaving."""
    codec: str = ""
    """Codec to insist on (name or spec); empty: use whatever the run's codec is."""
    batch_size: int = 16
    inner_lr: float = 1e-3
    """AdamW learning rate of the inner optimizer."""
    seed: int = 0
    """Model init seed (θ_0 comes from the bootstrap island, so only its seed matters)."""
    data_seed: int | None = None
    """Seed of this island's batch sampler; defaults to a hash of island_id."""
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    block_size: int = 64
    threads: int = 1
    """torch intra-op threads (islands on one small machine should not oversubscribe it)."""
    eval_every_round: bool = True
    give_up_seconds: float = 600.0
    nproc: int = 1
    """Ranks of this island; above 1, the island re-launches itself under torch.distributed.run."""
    parallel: str = "none"
    """How the ranks share the model: none, fsdp, tp or fsdp+tp."""
    digest: bool = True
    """Report a sha256 of the full θ after every pull (gathers θ: verification only)."""
    dump_dir: str = ""
    """If set, every rank writes the Δ shards it pushed in round 0 here (for tests)."""
    faults: str = ""
    """Island-side fault schedule as JSON (see atoll.harness.faults)."""
    sync_every_seconds: float = 0.0
    """If > 0, sync on this time budget instead of the run's H steps (adaptive inner steps)."""
    heartbeat_seconds: float = 5.0
    overlap_steps: int = 0
    """If > 0, keep training while the outer exchange is in flight; apply it this many steps later."""
    streaming: bool = False
    """Streaming DiLoCo: the coordinator's fragments (``--fragments P``) sync on staggered schedules."""
    token: str = ""
    """This island's bearer token (when the coordinator runs with --island-tokens)."""
    tls_ca: str = ""
    """CA of the coordinator's certificate: connect over TLS."""
    tls_cert: str = ""
    """This island's certificate (mutual TLS)."""
    tls_key: str = ""
    tls_server_name: str = ""
    """Name expected in the coordinator's certificate, if not the address's host."""

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {self.nproc}")
        if self.parallel not in MODES:
            raise ValueError(f"parallel must be one of {MODES}, got {self.parallel!r}")


def param_digest(params: dict[str, torch.Tensor]) -> str:
    """sha256 over the names and bytes of the tensors: equal digests = bitwise equal θ."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        # copy=True: .numpy() pins a storage as non-resizable, which FSDP2's own buffers must not be.
        h.update(params[name].detach().to("cpu", torch.float32, copy=True).contiguous().numpy().tobytes())
    return h.hexdigest()


def model_digest(model: torch.nn.Module) -> str:
    """Digest of the whole θ, gathered from the shards (collective on a multi-rank island)."""
    with torch.no_grad():
        return param_digest({n: full_tensor(p) for n, p in model.named_parameters()})


@torch.no_grad()
def evaluate(model: TinyGPT, data: CharDataset) -> float:
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in data.eval_batches():
        _, loss = model(x, y)
        total += loss.item() * x.numel()
        count += x.numel()
    if hasattr(model, "reshard"):  # FSDP2 root keeps its parameters gathered after a forward
        model.reshard()
    model.train(was_training)
    return total / count


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def relaunch_command(args: IslandArgs, argv: list[str]) -> list[str]:
    """``torch.distributed.run`` starting ``nproc`` ranks of this same island command.

    ``--nproc`` itself is dropped (the ranks read WORLD_SIZE; and the launcher's parser would take
    it for an abbreviation of its own ``--nproc-per-node``).
    """
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    return [*launcher, "-m", "atoll", *rest]


def run_island(args: IslandArgs, argv: list[str] | None = None) -> int:
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        if argv is None:
            raise ValueError("a multi-rank island needs its command line to re-launch itself")
        cmd = relaunch_command(args, argv)
        os.execv(cmd[0], cmd)  # the launcher replaces this process (same pid for the harness)
    torch.set_num_threads(args.threads)
    tune_for_bulk_buffers()  # our own island process (the DiLoCo class leaves a user's allocator alone)
    data = CharDataset(block_size=args.block_size)
    torch.manual_seed(args.seed)
    model = TinyGPT(
        GPTConfig(
            vocab_size=data.vocab_size,
            block_size=args.block_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
        )
    )
    layout = parallelize(model, args.parallel)
    lead = layout.rank == 0
    opt = torch.optim.AdamW(model.parameters(), lr=args.inner_lr, weight_decay=0.1, betas=(0.9, 0.95))
    data_seed = args.data_seed
    if data_seed is None:
        data_seed = int.from_bytes(hashlib.sha256(args.island_id.encode()).digest()[:4], "little")
    gen = torch.Generator().manual_seed(data_seed)
    if args.batch_size % layout.dp_size:
        raise ValueError(f"batch_size {args.batch_size} must divide over {layout.dp_size} data-parallel ranks")
    per_rank = args.batch_size // layout.dp_size
    faults = IslandFaults(args.faults)
    sync = DiLoCo(
        model,
        opt,
        coordinator=args.coordinator,
        codec=args.codec or None,
        run_id=args.run_id,
        island_id=args.island_id,
        retry=RetryPolicy(give_up_seconds=args.give_up_seconds),
        keep_last_delta=bool(args.dump_dir),
        sync_every_seconds=args.sync_every_seconds or None,
        heartbeat_seconds=args.heartbeat_seconds,
        overlap_steps=args.overlap_steps,
        streaming=args.streaming,
        client_factory=faults.client_factory,
        token=args.token or None,
        tls=ClientTls(
            ca=args.tls_ca,
            cert=args.tls_cert or None,
            key=args.tls_key or None,
            server_name=args.tls_server_name or None,
        )
        if args.tls_ca
        else None,
    )
    sync.start()
    try:
        start_eval = evaluate(model, data)
        digest = model_digest(model) if args.digest else None
        if lead:
            emit(
                "joined",
                island=args.island_id,
                round=sync.round,
                sync_every=sync.sync_every,
                eval_loss=start_eval,
                digest=digest,
                ranks=layout.world,
                parallel=layout.mode,
            )
        round_mark = time.perf_counter()

        def digest_now() -> str | None:
            if not args.digest:
                return None
            if args.overlap_steps:  # the model also holds progress made during the exchange
                return param_digest(sync.global_params()) if layout.world == 1 else None
            return model_digest(model)

        def report(stats) -> None:
            nonlocal round_mark
            if args.dump_dir and stats.round == 0:
                _dump_delta(Path(args.dump_dir), args.island_id, layout.rank, sync)
            round_seconds = time.perf_counter() - round_mark  # compute + sync of this round
            eval_loss = evaluate(model, data) if args.eval_every_round else None
            digest = digest_now()
            round_mark = time.perf_counter()  # evaluation and digests are not part of the round
            if lead:
                emit(
                    "round",
                    island=args.island_id,
                    round=stats.round,
                    now_round=sync.round,
                    loss=stats.loss,
                    global_loss=stats.global_loss,
                    eval_loss=eval_loss,
                    bytes_sent=stats.bytes_sent,
                    bytes_received=stats.bytes_received,
                    sync_seconds=stats.sync_seconds,
                    round_seconds=round_seconds,
                    inner_steps=stats.inner_steps,
                    tokens=stats.tokens,
                    update=stats.update_kind,
                    digest=digest,
                    max_payload_numel=stats.max_payload_numel,
                    step=sync.inner_steps,
                    shards=list(stats.shards),
                )

        while sync.rounds_pushed < args.rounds:
            faults.before_round(sync.round, first_step=sync.round_steps == 0)
            step_started = time.perf_counter()
            x, y = data.batch(gen, args.batch_size)  # the island's global batch; each dp rank takes its slice
            lo = layout.dp_rank * per_rank
            x, y = x[lo : lo + per_rank].to(layout.device), y[lo : lo + per_rank].to(layout.device)
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            faults.after_step(sync.round, time.perf_counter() - step_started)
            step_loss = loss.detach()
            if layout.world > 1:
                dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
            if not math.isfinite(step_loss.item()):
                raise FloatingPointError(f"inner loss is {step_loss.item()}")
            stats = sync.step(tokens=args.batch_size * args.block_size, loss=step_loss.item())
            if stats is not None:
                report(stats)
        for stats in sync.drain():  # overlap: the last exchanges, applied with no further steps
            report(stats)
    finally:
        sync.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if lead:
        emit("done", island=args.island_id, round=sync.round)
    return 0


def _dump_delta(dump_dir: Path, island_id: str, rank: int, sync: DiLoCo) -> None:
    from safetensors.torch import save_file

    dump_dir.mkdir(parents=True, exist_ok=True)
    tensors, meta = {}, {}
    for i, ((name, offsets, sizes), delta) in enumerate(sync.last_delta.items()):
        tensors[f"t{i}"] = delta.contiguous().cpu()
        meta[f"t{i}"] = json.dumps({"name": name, "offsets": list(offsets), "sizes": list(sizes)})
    save_file(tensors, str(dump_dir / f"{island_id}-rank{rank}.safetensors"), metadata=meta)


if __name__ == "__main__":  # pragma: no cover - used via `atoll island`
    sys.exit(run_island(IslandArgs(coordinator=sys.argv[1], island_id=sys.argv[2])))
