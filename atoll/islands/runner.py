"""The reference island: trains the tiny GPT on the bundled text under DiLoCo.

Prints one JSON object per line on stdout (``{"event": "round", ...}``) so the harness and the
demo can follow it; logs go to stderr.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass

import torch

from atoll.data import CharDataset
from atoll.islands.client import RetryPolicy
from atoll.islands.diloco import DiLoCo
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

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")


def param_digest(params: dict[str, torch.Tensor]) -> str:
    """sha256 over the names and bytes of the tensors: equal digests = bitwise equal θ."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def evaluate(model: TinyGPT, data: CharDataset) -> float:
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in data.eval_batches():
        _, loss = model(x, y)
        total += loss.item() * x.numel()
        count += x.numel()
    model.train(was_training)
    return total / count


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def run_island(args: IslandArgs) -> int:
    torch.set_num_threads(args.threads)
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
    opt = torch.optim.AdamW(model.parameters(), lr=args.inner_lr, weight_decay=0.1, betas=(0.9, 0.95))
    data_seed = args.data_seed
    if data_seed is None:
        data_seed = int.from_bytes(hashlib.sha256(args.island_id.encode()).digest()[:4], "little")
    gen = torch.Generator().manual_seed(data_seed)
    sync = DiLoCo(
        model,
        opt,
        coordinator=args.coordinator,
        codec=args.codec or None,
        run_id=args.run_id,
        island_id=args.island_id,
        retry=RetryPolicy(give_up_seconds=args.give_up_seconds),
    )
    sync.start()
    try:
        start_eval = evaluate(model, data)
        emit(
            "joined",
            island=args.island_id,
            round=sync.round,
            sync_every=sync.sync_every,
            eval_loss=start_eval,
            digest=param_digest(dict(model.named_parameters())),
        )
        while len(sync.history) < args.rounds:
            x, y = data.batch(gen, args.batch_size)
            _, loss = model(x, y)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"inner loss is {loss.item()}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats = sync.step(tokens=x.numel(), loss=loss.item())
            if stats is None:
                continue
            emit(
                "round",
                island=args.island_id,
                round=stats.round,
                now_round=sync.round,
                loss=stats.loss,
                global_loss=stats.global_loss,
                eval_loss=evaluate(model, data) if args.eval_every_round else None,
                bytes_sent=stats.bytes_sent,
                bytes_received=stats.bytes_received,
                sync_seconds=stats.sync_seconds,
                update=stats.update_kind,
                digest=param_digest(dict(model.named_parameters())),
            )
    finally:
        sync.close()
    emit("done", island=args.island_id, round=sync.round)
    return 0


if __name__ == "__main__":  # pragma: no cover - used via `atoll island`
    sys.exit(run_island(IslandArgs(coordinator=sys.argv[1], island_id=sys.argv[2])))
