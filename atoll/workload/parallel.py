"""Parallelise the reference model inside one island: FSDP2, tensor parallel, or both (2-D mesh).

Runs under torch.distributed's launcher (``torchrun``): gloo on CPU, nccl on GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

MODES = ("none", "fsdp", "tp", "fsdp+tp")


@dataclass(frozen=True)
class Layout:
    mode: str
    world: int
    rank: int
    dp_size: int
    """Ranks that see different data (FSDP's data-parallel axis)."""
    dp_rank: int
    device: torch.device
    dp_group: object = None
    """The process group of the ranks that see different data (their tokens add up); None: one rank."""


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the island's process group if launched with more than one rank; (rank, world, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "proj": RowwiseParallel(),
        "fc": ColwiseParallel(),
        "fc_proj": RowwiseParallel(),
    }


def parallelize(model: torch.nn.Module, mode: str, *, tp_size: int = 2) -> Layout:
    """Shard ``model`` (a TinyGPT) in place across the island's ranks."""
    if mode not in MODES:
        raise ValueError(f"parallel mode must be one of {MODES}, got {mode!r}")
    rank, world, device = init_distributed()
    model.to(device)
    if mode == "none" or world == 1:
        if mode != "none" and world == 1:
            raise ValueError(f"--parallel {mode} needs more than one rank (use --nproc)")
        return Layout("none", world, rank, world, rank, device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if mode == "fsdp":
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return Layout(mode, world, rank, world, rank, device, mesh.get_group())
    if mode == "tp":
        mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("dp", "tp"))
        _check_heads(model, world)
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], _tp_plan())
        return Layout(mode, world, rank, 1, 0, device, mesh["dp"].get_group())
    if world % tp_size or world == tp_size:
        raise ValueError(f"fsdp+tp needs a multiple of tp_size={tp_size} ranks greater than it, got {world}")
    mesh = init_device_mesh(device.type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    _check_heads(model, tp_size)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], _tp_plan())
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp_rank = mesh.get_local_rank("dp")
    return Layout(mode, world, rank, world // tp_size, dp_rank, device, mesh["dp"].get_group())


def _check_heads(model, tp: int) -> None:
    n_head, n_embd = model.cfg.n_head, model.cfg.n_embd
    if n_head % tp or (4 * n_embd) % tp:
        raise ValueError(f"tensor parallelism over {tp} ranks needs n_head ({n_head}) divisible by {tp}")


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter (collective for DTensors). For verification only: it materialises θ."""
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p
