"""``atoll island``: the reference island, a GPT trained under DiLoCo on the bundled text or the user's data.

On a terminal it shows its progress; otherwise it prints one JSON object per line on stdout
(``{"event": "round", ...}``) for the harness and the demo to follow. Logs go to stderr.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from atoll.data import CharDataset
from atoll.data.tokens import TokenDataset
from atoll.islands import DiLoCo
from atoll.islands.errors import Preempted, QuorumGone
from atoll.memory import tune_for_bulk_buffers
from atoll.models import PRESETS, TinyGPT, card_of, preset
from atoll.workload.connect import coordinator_link
from atoll.workload.digest import model_digest, param_digest
from atoll.workload.hooks import IslandHooks
from atoll.workload.inner import InnerOptimizer
from atoll.workload.options import IslandArgs
from atoll.workload.parallel import Layout, parallelize
from atoll.workload.progress import Reporter


def autocast(device: torch.device):
    """bf16 autocast on accelerators (fp32 master weights); plain fp32 on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if device.type != "cpu" else nullcontext()


@torch.no_grad()
def evaluate(model: TinyGPT, data, device: torch.device | None = None) -> float:
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    total, count = 0.0, 0
    for x, y in data.eval_batches():
        with autocast(device):
            _, loss = model(x.to(device), y.to(device))
        total += loss.item() * x.numel()
        count += x.numel()
    if hasattr(model, "reshard"):  # FSDP2 root keeps its parameters gathered after a forward
        model.reshard()
    model.train(was_training)
    return total / count


def relaunch_command(args: IslandArgs, argv: list[str], hooks: IslandHooks | None = None) -> list[str]:
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
    hooks = hooks or IslandHooks()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    return [*launcher, "-m", hooks.module, *hooks.relaunch_argv(), *rest]


@dataclass(frozen=True)
class InnerLoop:
    """What the island trains between syncs, built once by :func:`run_island`."""

    model: torch.nn.Module
    opt: InnerOptimizer
    """The inner optimizer(s) and their learning-rate schedule."""
    data: CharDataset | TokenDataset
    gen: torch.Generator
    """The data order (seeded per island; checkpointed with it)."""
    layout: Layout
    per_rank: int
    """This rank's share of the island's batch."""


def load_data(args: IslandArgs, block_size: int):
    if not args.data:
        return CharDataset(block_size=block_size)
    return TokenDataset.from_file(args.data, block_size=block_size, vocab_size=args.vocab_size)


def build_model(args: IslandArgs, vocab_size: int) -> TinyGPT:
    cfg = preset(
        args.model,
        vocab_size=vocab_size,
        n_layer=args.n_layer or None,
        n_embd=args.n_embd or None,
        n_head=args.n_head or None,
        block_size=args.block_size or None,
    )
    torch.manual_seed(args.seed)
    return TinyGPT(cfg)


def run_island(args: IslandArgs, argv: list[str] | None = None, hooks: IslandHooks | None = None) -> int:
    """Run the island. ``argv``: its command line (a multi-rank island re-launches itself with it);
    ``hooks``: seams of the loop (the harness injects faults there; default: none)."""
    hooks = hooks or IslandHooks()
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        if argv is None:
            raise ValueError("a multi-rank island needs its command line to re-launch itself")
        cmd = relaunch_command(args, argv, hooks)
        os.execv(cmd[0], cmd)  # the launcher replaces this process (same pid for the harness)
    torch.set_num_threads(args.threads)
    tune_for_bulk_buffers(heap=False)  # huge pages only (see atoll.memory); DiLoCo itself tunes nothing
    block = args.block_size or PRESETS[args.model]["block_size"]
    data = load_data(args, block)
    model = build_model(args, data.vocab_size)
    layout = parallelize(model, args.parallel)
    opt = InnerOptimizer.build(
        model, args.inner_optimizer, args.inner_lr, args.lr_warmup_steps, sharded=layout.mode != "none"
    )
    data_seed = args.data_seed
    if data_seed < 0:
        data_seed = int.from_bytes(hashlib.sha256(args.island_id.encode()).digest()[:4], "little")
    gen = torch.Generator().manual_seed(data_seed)
    if args.batch_size % layout.dp_size:
        raise ValueError(f"batch_size {args.batch_size} must divide over {layout.dp_size} data-parallel ranks")
    per_rank = args.batch_size // layout.dp_size
    ckpt = None
    if args.checkpoint_dir:
        from atoll.islands.checkpoint import IslandCheckpoint

        def load_state(s: dict) -> None:
            opt.load_schedule_state(s["scheduler"])
            gen.set_state(s["generator"])

        ckpt = IslandCheckpoint(
            args.checkpoint_dir,
            model,
            opt.optimizers,
            state=lambda: {"scheduler": opt.schedule_state(), "generator": gen.get_state()},
            load_state=load_state,
        )

    def before_push(sync: DiLoCo):
        """Checkpoint the island; the push waits for the write (returned), so every push the
        coordinator counts has a checkpoint behind it."""
        if args.dump_dir and sync.round == 0:
            _dump_delta(Path(args.dump_dir), args.island_id, layout.rank, sync)
        return ckpt.save(sync) if ckpt is not None else None

    link = coordinator_link(args, hooks)
    sync = DiLoCo(
        model,
        link,
        codec=args.codec or None,
        sync_every_seconds=args.sync_every_seconds or None,
        overlap_steps=args.overlap_steps,
        align_pushes=args.align_pushes,
        update_wait=args.update_wait,
        streaming=args.streaming,
        outer_state=args.outer_state,
        staged_copies=None if args.staged_copies else False,
        token_group=layout.dp_group,
        before_push=before_push if ckpt or args.dump_dir else None,
        model_card=card_of(model, symbols=getattr(data, "chars", None), vocab_size=data.vocab_size),
    )
    resumed = ckpt.load(sync) if ckpt else False
    reporter = Reporter(
        args.progress, lead=layout.rank == 0, island=args.island_id, progress_seconds=args.progress_seconds
    )
    try:
        sync.start()
        loop = InnerLoop(model, opt, data, gen, layout, per_rank)
        _train(args, loop, sync, hooks=hooks, reporter=reporter, ckpt=ckpt, resumed=resumed)
        done = {"round": sync.round, "run_complete": sync.run_complete}
    except Preempted:  # SIGTERM: checkpoint where it stands (mid-round too), leave, exit 143
        done = {"round": sync.round, "run_complete": False, "preempted": True, "step": sync.inner_steps}
        if ckpt is not None:
            ckpt.save(sync)
    except QuorumGone as err:  # its last round: the others left, nothing will close it
        logging.getLogger("atoll.island").warning("%s; leaving without its outer step", err)
        done = {"round": sync.round, "run_complete": False, "quorum_gone": True}
    finally:
        sync.close()
        if ckpt is not None:
            ckpt.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
    reporter.event("done", **done)
    return 143 if done.get("preempted") else 0


def _train(
    args: IslandArgs,
    loop: InnerLoop,
    sync: DiLoCo,
    *,
    hooks: IslandHooks,
    reporter: Reporter,
    ckpt,
    resumed: bool,
) -> None:
    model, opt, data, gen, layout, per_rank = loop.model, loop.opt, loop.data, loop.gen, loop.layout, loop.per_rank
    device = layout.device
    start_eval = evaluate(model, data, device)
    digest = model_digest(model) if args.digest else None
    reporter.event(
        "joined",
        round=sync.round,
        sync_every=sync.sync_every,
        eval_loss=start_eval,
        digest=digest,
        ranks=layout.world,
        parallel=layout.mode,
        resumed=resumed,
        run_complete=sync.run_complete,
    )
    round_mark = time.perf_counter()

    def digest_now() -> str | None:
        if not args.digest:
            return None
        if args.overlap_steps or sync.decoupled:  # the model also holds progress made during the exchange
            return param_digest(sync.global_params()) if layout.world == 1 else None
        return model_digest(model)

    steps: dict[bool, list[float]] = {False: [], True: []}
    """This round's inner steps (compute, up to the loss on the host) by whether an exchange was in flight."""

    def report(stats) -> None:
        nonlocal round_mark
        round_seconds = time.perf_counter() - round_mark  # compute + sync of this round
        eval_loss = evaluate(model, data, device) if args.eval_every_round else None
        digest = digest_now()
        round_mark = time.perf_counter()  # evaluation and digests are not part of the round
        reporter.event(
            "round",
            round=stats.round,
            now_round=sync.round,
            loss=stats.loss,
            global_loss=stats.global_loss,
            eval_loss=eval_loss,
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            sync_seconds=stats.sync_seconds,
            host_seconds=stats.host_seconds,
            exchange_seconds=stats.exchange_seconds,
            background_seconds=stats.background_seconds,
            round_seconds=round_seconds,
            inner_steps=stats.inner_steps,
            tokens=stats.tokens,
            update=stats.update_kind,
            digest=digest,
            max_payload_numel=stats.max_payload_numel,
            step=sync.inner_steps,
            shards=list(stats.shards),
            dropped=stats.dropped,
            run_complete=stats.run_complete,
            gpu_peak_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            checkpoint_seconds=ckpt.seconds if ckpt is not None else 0.0,
            step_seconds=_mean(steps[False]),
            step_seconds_in_flight=_mean(steps[True]),
        )
        steps[False], steps[True] = [], []

    pushed_before, until_round = sync.rounds_pushed, sync.round + args.rounds
    while not sync.run_complete:
        left = rounds_left(sync, args.rounds, pushed_before, until_round) if args.rounds else None
        if left == 0:
            break
        if left == 1:
            sync.last_round()  # the exchange it starts next is its last
        hooks.before_round(sync.round, first_step=sync.round_steps == 0)
        step_started, exchanging = time.perf_counter(), sync.exchanging
        x, y = data.batch(gen, args.batch_size)  # the island's global batch; each dp rank takes its slice
        lo = layout.dp_rank * per_rank
        x, y = x[lo : lo + per_rank].to(device), y[lo : lo + per_rank].to(device)
        with autocast(device):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        hooks.after_step(sync.round, time.perf_counter() - step_started)
        step_loss = loss.detach().float()
        if layout.world > 1:
            dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
        if not math.isfinite(step_loss.item()):  # (the host waits for the step's kernels here)
            raise FloatingPointError(f"inner loss is {step_loss.item()}")
        steps[exchanging].append(time.perf_counter() - step_started)
        stats = sync.step(tokens=per_rank * x.shape[1], loss=step_loss.item())
        reporter.step(
            sync, step_loss.item(), per_rank * x.shape[1] * layout.dp_size, time.perf_counter() - step_started
        )
        if stats is not None:
            report(stats)
    for stats in sync.drain():  # overlap: the last exchanges, applied with no further steps
        report(stats)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def rounds_left(sync, rounds: int, pushed_before: int, until_round: int) -> int:
    """Rounds ``atoll island --rounds N`` has left to push: no more than N pushes in all (those since
    ``pushed_before``), and none once it holds θ of ``until_round`` (the round it started at plus N: a
    round it missed, catching up, counts). Counting pushes alone, an island that lost a round to a
    coordinator restart pulled a later θ, pushed one round more than its peers and then waited for a
    quorum that had left."""
    by_pushes = rounds - (sync.rounds_pushed - pushed_before)
    return max(0, min(by_pushes, until_round - sync.round))


def _dump_delta(dump_dir: Path, island_id: str, rank: int, sync: DiLoCo) -> None:
    from safetensors.torch import save_file

    dump_dir.mkdir(parents=True, exist_ok=True)
    tensors, meta = {}, {}
    for i, ((name, offsets, sizes), delta) in enumerate(sync.pseudo_gradient().items()):
        tensors[f"t{i}"] = delta.contiguous().cpu()
        meta[f"t{i}"] = json.dumps({"name": name, "offsets": list(offsets), "sizes": list(sizes)})
    save_file(tensors, str(dump_dir / f"{island_id}-rank{rank}.safetensors"), metadata=meta)
