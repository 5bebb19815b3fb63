"""One prepared script for an accelerator machine: GPU islands at a real model size.

    python benchmarks/gpu.py            # on a machine with one CUDA GPU (~5 minutes)
    python benchmarks/gpu.py --dry-run  # the same steps on the CPU with a tiny model (checks the script)

A coordinator and two single-GPU islands sharing the one GPU train a 124M-parameter GPT (bf16
autocast) on generated token data (a random sparse bigram chain, so the loss can fall), H=50, with
the identity and int8 codecs, with and without --overlap-steps. It prints:

- θ digests identical across the islands after every round, and the loss falling;
- sync time as % of the round (the islands' own timings), staged (the default since issue 35) and,
  for int8, with --no-staged-copies beside it;
- with overlap, an inner step's time while an exchange is in flight against one while none is;
- int8 and identity encode/decode GB/s on the GPU beside a device memcpy of the same tensor (on the
  device, end to end to a fresh host payload, and staged through pinned buffers);
- each island's peak GPU memory (torch.cuda.max_memory_allocated) beside the same loop without
  atoll, in this process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)
import numpy as np
import torch

from atoll.harness import ProcessGroup

VOCAB = 50257


def make_tokens(path: Path, num_tokens: int, vocab: int, seed: int = 0) -> None:
    """A token file of many chains through a random bigram table with 8 successors per token."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, vocab, size=(vocab, 8), dtype=np.int64)
    chains, length = 4096, max(2, num_tokens // 4096)
    state = rng.integers(0, vocab, size=chains)
    out = np.empty((length, chains), dtype=np.uint16)
    for t in range(length):
        out[t] = state
        state = table[state, rng.integers(0, 8, size=chains)]
    out.T.reshape(-1).tofile(path)
    path.with_name(path.name + ".json").write_text(json.dumps({"vocab_size": vocab}))


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        sync_device(device)
        started = time.perf_counter()
        fn()
        sync_device(device)
        best = min(best, time.perf_counter() - started)
    return best


def codec_speeds(device: torch.device, numel: int) -> None:
    from atoll.compression import get_codec

    x = torch.randn(numel, device=device) * 0.01
    dst = torch.empty_like(x)
    memcpy = timed(lambda: dst.copy_(x), device)
    gb = x.numel() * 4 / 1e9
    print(f"\ncodecs on {device} ({numel:,} fp32 elements); GB/s of fp32 input, ratio to a device memcpy")
    print(f"{'':30} {'GB/s':>8} {'x memcpy':>9}")
    print(f"{'device memcpy':30} {gb / memcpy:8.1f} {1.0:9.3f}")
    for spec in ("int8", "identity"):
        codec = get_codec(spec)
        payload = codec.encode(x)
        enc = timed(lambda c=codec: c.encode(x), device)
        dec = timed(lambda c=codec, p=payload: c.decode_add_(p, dst), device)
        print(f"{spec + ' encode (to host payload)':30} {gb / enc:8.1f} {memcpy / enc:9.3f}")
        print(f"{spec + ' decode-add (from host)':30} {gb / dec:8.1f} {memcpy / dec:9.3f}")
    # The quantisation alone, on the device (what the codec computes before the payload's D2H copy).
    block = 256
    q = torch.empty(numel, dtype=torch.int8, device=device)

    def quantise():
        v = x.view(-1, block)
        scale = v.abs().amax(dim=1, keepdim=True).div_(127)
        q.view(-1, block).copy_(torch.round(v / scale))

    dev = timed(quantise, device)
    print(f"{'int8 quantise (on the device)':30} {gb / dev:8.1f} {memcpy / dev:9.3f}")
    staged_speeds(x, dst, gb, memcpy, device)


def staged_speeds(x: torch.Tensor, dst: torch.Tensor, gb: float, memcpy: float, device: torch.device) -> None:
    """The island's path since issue 35 (atoll.compression.staging): the codec writes a device mirror,
    one copy moves the payload to a pinned buffer reused from call to call (on a side stream), and the
    payload is sealed once there; a pulled payload in pinned memory crosses to the device in one copy
    and is decoded there. Beside them, the floor: one pinned copy of the payload's bytes alone."""
    from atoll.compression import get_codec
    from atoll.compression.staging import DeviceStaging, pinned_buffer

    staging = DeviceStaging(device, enabled=True)
    print(f"{'(staged: goal >= 20 GB/s)':30}")
    for spec in ("int8", "identity"):
        codec, stage = get_codec(spec), staging.buffers()
        size = codec.encoded_size(tuple(x.shape))

        def encode(codec=codec, stage=stage, size=size):
            room = stage.payload_buffer(size)
            with stage.encoding():
                payload = codec.encode(x, out=room)
            return staging.settle(payload)

        payload = encode()
        assert bytes(payload) == bytes(codec.encode(x)), "the staged payload differs from the direct one"
        pulled = pinned_buffer(len(payload)) if device.type == "cuda" else np.empty(len(payload), np.uint8)
        pulled[:] = np.frombuffer(payload, dtype=np.uint8)

        def decode(codec=codec, stage=stage, pulled=pulled):
            with stage.reading(pulled):
                codec.decode_add_(pulled, dst, verified=True)

        enc, dec = timed(encode, device), timed(decode, device)
        floor = float("nan")
        if device.type == "cuda":
            on_device = torch.empty(len(payload), dtype=torch.uint8, device=device)
            host = torch.from_numpy(pulled)
            floor = timed(lambda h=host, d=on_device: h.copy_(d, non_blocking=True), device)
        print(f"{spec + ' encode (staged, pinned)':30} {gb / enc:8.1f} {memcpy / enc:9.3f}")
        print(f"{spec + ' decode-add (staged, pinned)':30} {gb / dec:8.1f} {memcpy / dec:9.3f}")
        print(f"{spec + ' payload D2H copy alone':30} {gb / floor:8.1f} {memcpy / floor:9.3f}")


def plain_loop_peak(model_name: str, batch: int, block: int, steps: int, device: torch.device, data) -> int:
    """Peak GPU memory of the island's loop without atoll: the same model, optimizer and batches."""
    from atoll.models import TinyGPT, preset
    from atoll.workload.island import autocast

    torch.manual_seed(0)
    model = TinyGPT(preset(model_name, vocab_size=data.vocab_size, block_size=block)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        x, y = data.batch(gen, batch)
        with autocast(device):
            _, loss = model(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peak


def run(work: Path, data_path: Path, args, codec: str, overlap: int, staged: bool = True) -> list[dict]:
    with ProcessGroup(work) as group:
        coord, address = group.start_coordinator(
            work / "state",
            [
                *("--run-id", "gpu", "--sync-every", str(args.sync_every), "--codec", codec, "--quorum", "2"),
                *("--round-deadline-seconds", "600", "--outer-lr", "0.7", "--outer-momentum", "0.9"),
            ],
            timeout=120,
        )
        islands = [
            group.start(
                f"i{k}",
                [
                    *("island", "--coordinator", address, "--island-id", f"i{k}", "--run-id", "gpu"),
                    *("--rounds", str(args.rounds), "--data", str(data_path), "--model", args.model),
                    *("--batch-size", str(args.batch_size), "--block-size", str(args.block_size)),
                    *("--inner-lr", "3e-4", "--overlap-steps", str(overlap), "--no-eval-every-round"),
                    *("--progress", "json", "--threads", "4"),
                    *(() if staged else ("--no-staged-copies",)),
                ],
            )
            for k in range(2)
        ]
        events = []
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in islands) or any(not p.events.empty() for p in islands):
            if time.monotonic() > deadline:
                raise TimeoutError("islands did not finish: " + islands[0].log_tail())
            for p in islands:
                ev = p.next_event(0.05)
                if ev is not None:
                    events.append(ev)
        codes = [p.wait(30) for p in islands]
        coord.stop()
        if codes != [0, 0]:
            raise RuntimeError(f"islands exited {codes}: {islands[0].log_tail()}")
    return [e for e in events if e["event"] == "round"]


def report(rounds: list[dict], plain_peak: int, label: str) -> None:
    by_round: dict[int, dict] = {}
    for e in rounds:
        by_round.setdefault(e["round"], {})[e["island"]] = e
    print(f"\n== {label}")
    print(f"{'round':>5} {'global loss':>11} {'θ identical':>11} {'sync % of round':>16} {'peak GPU / plain':>17}")
    shares = []
    for r in sorted(by_round):
        evs = list(by_round[r].values())
        same = len({e["digest"] for e in evs}) == 1 and len(evs) == 2
        share = [100 * e["sync_seconds"] / e["round_seconds"] for e in evs if e["round_seconds"]]
        if r > 0:  # round 0 includes the islands' warm-up
            shares += share
        peak = max(e.get("gpu_peak_bytes") or 0 for e in evs)
        ratio = f"{peak / plain_peak:17.3f}" if plain_peak else f"{'-':>17}"
        loss = evs[0]["global_loss"]
        print(f"{r:>5} {loss:11.4f} {'yes' if same else 'NO':>11} {max(share):16.2f} {ratio}")
    idle = [e["step_seconds"] for e in rounds if e["round"] > 0 and e.get("step_seconds")]
    busy = [e["step_seconds_in_flight"] for e in rounds if e["round"] > 0 and e.get("step_seconds_in_flight")]
    if idle and busy:  # overlap: an inner step while the exchange is in flight, against one while none is
        ratio = statistics.mean(busy) / statistics.mean(idle)
        print(
            f"inner step (mean of the islands' round means): {statistics.mean(idle) * 1e3:.1f} ms with no "
            f"exchange in flight, {statistics.mean(busy) * 1e3:.1f} ms with one: {ratio:.3f}x (goal <= 1.02x)"
        )
    losses = [next(iter(by_round[r].values()))["global_loss"] for r in sorted(by_round)]
    print(
        f"loss falling: {'yes' if losses[-1] < losses[0] else 'NO'} ({losses[0]:.4f} -> {losses[-1]:.4f}); "
        f"sync share after warm-up: median {statistics.median(shares) if shares else 0:.2f}%"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with a tiny model")
    p.add_argument("--model", default="gpt-125m", help="model preset (default: gpt-125m)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per inner step per island (default: 16)")
    p.add_argument("--block-size", type=int, default=1024, help="tokens per sequence (default: 1024)")
    p.add_argument("--sync-every", type=int, default=50, help="H (default: 50)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per configuration (default: 3)")
    p.add_argument("--overlap-steps", type=int, default=10, help="τ of the overlapped runs (default: 10)")
    p.add_argument("--codec-numel", type=int, default=1 << 26, help="elements of the codec benchmark tensor")
    p.add_argument("--timeout", type=float, default=600, help="seconds per configuration before failing")
    p.add_argument("--staged-only", action="store_true", help="skip the two runs with --no-staged-copies")
    args = p.parse_args()
    if args.dry_run:
        args.model, args.batch_size, args.block_size, args.sync_every = "tiny", 4, 64, 5
        args.rounds, args.overlap_steps, args.codec_numel = 3, 2, 1 << 20
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run to check the script on the CPU")
    device = torch.device("cuda", 0) if not args.dry_run else torch.device("cpu")
    print(
        f"device {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
        f"model {args.model}, batch {args.batch_size} x {args.block_size} tokens, H={args.sync_every}"
    )
    codec_speeds(device, args.codec_numel)
    with tempfile.TemporaryDirectory(prefix="atoll-gpu-") as tmp:
        tmp = Path(tmp)
        data_path = tmp / "train.bin"
        make_tokens(data_path, 8_000_000 if not args.dry_run else 200_000, VOCAB if not args.dry_run else 512)
        from atoll.data.tokens import TokenDataset

        data = TokenDataset.from_file(data_path, block_size=args.block_size)
        plain = plain_loop_peak(args.model, args.batch_size, args.block_size, args.sync_every, device, data)
        if plain:
            print(f"\nthe same loop without atoll: peak GPU memory {plain / 2**30:.2f} GiB")
        configs = [(c, o, True) for c in ("identity", "int8") for o in (0, args.overlap_steps)]
        if not args.staged_only:  # the path before issue 35 beside it, on the same machine
            configs += [("int8", o, False) for o in (0, args.overlap_steps)]
        for codec, overlap, staged in configs:
            rounds = run(tmp / f"{codec}-{overlap}-{staged}", data_path, args, codec, overlap, staged)
            how = "staged copies" if staged else "direct copies (--no-staged-copies)"
            report(rounds, plain, f"{codec}, overlap {overlap}, outer state on the host, {how}")


if __name__ == "__main__":
    main()
