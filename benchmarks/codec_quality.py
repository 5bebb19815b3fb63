"""Bytes against quality, codec by codec: θ's eval loss at equal tokens, and the bytes the islands
counted on the wire, for each codec spec over several seeds.

    python benchmarks/codec_quality.py [--codecs identity int8 sparse ...] [--downlink same|SPEC]
        [--sync-every 30 100] [--rounds 12 4] [--islands 3] [--seeds 0 1 2]
        [--model-flags "--n-layer 4 --n-embd 256"] [--island-flags "..."] [--coordinator-flags "..."]
        [--json out.json]

Every run: one coordinator (sync, every round waits for all the islands: equal tokens per round
whatever the codec) and ``--islands`` reference islands (``atoll island``) that train ``--rounds``
rounds of H = ``--sync-every`` inner steps and leave, on text drawn from the bundled text's order-3
statistics (``goodput.make_text_corpus``: every window new, a run cannot memorise it). The model is
the tiny GPT widened by ``--model-flags`` (default 4 layers of 256: 3.2M parameters). Lossy codecs
run with error feedback on both sides (``--error-feedback``). ``--downlink same`` sends the update
in the uplink's codec; a spec sends it in that one (identity and int8 keep their own codec down).

Printed per codec: the islands' bytes a round up and down, counted by the islands (every payload,
header, index and scale), as a ratio to fp32 (4 bytes a parameter); θ's eval loss after the last
round, the mean over seeds and each seed, and the gap to identity's for the same seed; and whether
every island's θ was bitwise the same after every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)
from goodput import make_text_corpus  # benchmarks/goodput.py, beside this

from atoll.compression import codec_name
from atoll.coordinator.disk import snapshots
from atoll.harness import ProcessGroup

COMMON = ["--run-id", "cq", "--outer-lr", "1.0", "--outer-momentum", "0.5", "--lease-seconds", "10"]
COMMON += ["--bulk-port", "-1", "--keep-snapshots", "100000", "--snapshot-every", "1"]


def downlink_of(codec: str, downlink: str) -> str:
    if downlink == "same" or codec_name(codec) in ("identity", "int8", "fp16", "bf16"):
        return codec
    return downlink


def island_argv(name: str, address: str, work: Path, seed: int, rounds: int, a) -> list[str]:
    return [
        "island", "--data", str(work.parent / "corpus.bin"), "--coordinator", address, "--island-id", name,
        "--run-id", "cq", "--inner-lr", "3e-3", "--heartbeat-seconds", "0.5", "--give-up-seconds", "300",
        "--no-eval-every-round", "--seed", str(seed), "--data-seed", str(1000 * seed + ord(name)),
        "--batch-size", str(a.batch_size), "--rounds", str(rounds), *a.model_flags.split(), *a.island_flags.split(),
    ]  # fmt: skip


def run(codec: str, h: int, rounds: int, seed: int, a, work: Path) -> dict:
    work.mkdir(parents=True)
    lossy = codec_name(codec) != "identity"
    down = downlink_of(codec, a.downlink)
    flags = [*COMMON, "--codec", codec, "--downlink-codec", down, "--sync-every", str(h)]
    flags += ["--quorum", str(a.islands), "--total-rounds", str(rounds)]
    flags += ["--error-feedback"] if lossy else []
    flags += a.coordinator_flags.split()  # (after the rest: argparse keeps a flag's last value)
    names = [chr(ord("A") + i) for i in range(a.islands)]
    sent, received, digests = {}, {}, {}
    t0 = time.monotonic()
    with ProcessGroup(work) as group:
        coord, address = group.start_coordinator(work / "state", flags)
        procs = [group.start(name, island_argv(name, address, work, seed, rounds, a)) for name in names]
        for p in procs:
            if p.wait(timeout=a.timeout) != 0:
                raise RuntimeError(f"island {p.name} exited with {p.poll()}:\n{p.log_tail()}")
            while (e := p.next_event(timeout=0.01)) is not None:
                if e.get("event") == "round":
                    sent.setdefault(e["round"], {})[p.name] = e["bytes_sent"]
                    received.setdefault(e["round"], {})[p.name] = e["bytes_received"]
                    digests.setdefault(e["round"], set()).add(e["digest"])
        coord.stop()
    seconds = time.monotonic() - t0
    curve = evaluate(work / "state", str(work.parent / "corpus.bin"), a.model_flags)
    steady = [r for r in sorted(sent) if r > 0 and len(sent[r]) == a.islands]  # round 0 also carries θ_0
    return {
        "codec": codec, "downlink": down, "flags": a.coordinator_flags, "island_flags": a.island_flags,
        "sync_every": h, "rounds": rounds,
        "seed": seed, "curve": curve,
        "seconds": seconds,
        "up_per_island": statistics.mean(statistics.mean(sent[r].values()) for r in steady) if steady else None,
        "down_per_island": statistics.mean(statistics.mean(received[r].values()) for r in steady) if steady else None,
        "identical": all(len(d) == 1 for d in digests.values()) and bool(digests),
    }  # fmt: skip


def island_args(model_flags: str, data: str = ""):
    from atoll.workload.island import IslandArgs

    flags = model_flags.split()
    sizes = {f.removeprefix("--").replace("-", "_"): int(v) for f, v in zip(flags[::2], flags[1::2], strict=True)}
    return IslandArgs(coordinator="-", island_id="eval", data=data, **sizes)


def parameters(model_flags: str) -> int:
    from atoll.workload.island import build_model

    return sum(p.numel() for p in build_model(island_args(model_flags), 65).parameters())


def evaluate(state_dir: Path, corpus: str, model_flags: str) -> list[tuple[int, int, float]]:
    """θ's held-out loss after every round: [(round, tokens into θ, eval loss)], θ_0 first."""
    from atoll.models import PRESETS
    from atoll.workload.island import build_model, load_data
    from atoll.workload.island import evaluate as eval_loss

    args = island_args(model_flags, corpus)
    data = load_data(args, args.block_size or PRESETS[args.model]["block_size"])
    model = build_model(args, data.vocab_size)
    out = []
    for path in snapshots.snapshot_paths(state_dir):
        snap = snapshots.verify(path)
        missing, unexpected = model.load_state_dict(snap.params, strict=False)
        if unexpected or {n for n, _ in model.named_parameters()} & set(missing):
            raise RuntimeError(f"the run's θ does not fit the model: missing {missing}, unexpected {unexpected}")
        out.append((len(snap.history), sum(r["tokens"] for r in snap.history), eval_loss(model, data)))
    return out


def report(runs: list[dict], numel: int) -> None:
    base = {key_of(r): r["curve"][-1][2] for r in runs if r["codec"] == "identity"}
    print(f"\n{numel:,} parameters; fp32 = {4 * numel:,} bytes")
    print(f"{'H':>4} {'codec (up)':<40} {'down':<28} {'up x':>7} {'down x':>7} {'loss (mean)':>11} {'vs identity':>12}"
          "  seeds (loss, gap)  θ same")  # fmt: skip
    for h in sorted({r["sync_every"] for r in runs}):
        for key in dict.fromkeys(variant(r) for r in runs if r["sync_every"] == h):
            rs = [r for r in runs if r["sync_every"] == h and variant(r) == key]
            up = statistics.mean(r["up_per_island"] for r in rs)
            down = statistics.mean(r["down_per_island"] for r in rs)
            losses = [r["curve"][-1][2] for r in rs]
            gaps = [r["curve"][-1][2] / base[key_of(r)] - 1 for r in rs if key_of(r) in base]
            gap = f"{100 * statistics.mean(gaps):+.2f}%" if gaps else "-"
            seeds = ", ".join(
                f"{r['seed']}: {r['curve'][-1][2]:.4f}"
                + (f" ({100 * (r['curve'][-1][2] / base[key_of(r)] - 1):+.2f}%)" if key_of(r) in base else "")
                for r in rs
            )
            same = "yes" if all(r["identical"] for r in rs) else "NO"
            codec, down_codec, flags = key
            flags = f"  [{flags}]" if flags else ""
            print(f"{h:>4} {codec:<40} {down_codec:<28} {4 * numel / up:7.1f} {4 * numel / down:7.1f} "
                  f"{statistics.mean(losses):11.4f} {gap:>12}  {seeds}  {same}{flags}")  # fmt: skip


def variant(r: dict) -> tuple[str, str, str]:
    """What a row of the table is: the codec up, the one down and the extra flags (coordinator's, islands')."""
    return r["codec"], r["downlink"], " ".join(f for f in (r.get("flags", ""), r.get("island_flags", "")) if f)


def key_of(r: dict) -> tuple[int, int, str]:
    """The identity run a run is measured against: same H, seed and island flags."""
    return r["sync_every"], r["seed"], r.get("island_flags", "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codecs", nargs="+", default=["identity", "int8", "sparse"])
    p.add_argument("--downlink", default="same", help="'same' (the uplink's codec) or a codec spec")
    p.add_argument("--sync-every", type=int, nargs="+", default=[30])
    p.add_argument("--rounds", type=int, nargs="+", default=[12], help="rounds of each H (one, or one per H)")
    p.add_argument("--islands", type=int, default=3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--model-flags", default="--n-layer 4 --n-embd 256")
    p.add_argument("--island-flags", default="", help='more `atoll island` flags ("--inner-optimizer muon")')
    p.add_argument("--coordinator-flags", default="", help='more coordinator flags ("--outer-momentum 0 ...")')
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--pool", type=Path, nargs="+", default=None, help="run nothing: these --json files' runs")
    a = p.parse_args()
    numel = parameters(a.model_flags)
    if a.pool:
        report([r for f in a.pool for r in json.loads(f.read_text())["runs"]], numel)
        return
    rounds = a.rounds if len(a.rounds) == len(a.sync_every) else a.rounds * len(a.sync_every)
    runs = []
    with tempfile.TemporaryDirectory(prefix="cq-") as tmp:
        make_text_corpus(Path(tmp) / "corpus.bin")
        for h, n in zip(a.sync_every, rounds, strict=True):
            for codec in a.codecs:
                for seed in a.seeds:
                    r = run(codec, h, n, seed, a, Path(tmp) / f"{codec.replace(':', '_')}-h{h}-s{seed}")
                    runs.append(r)
                    if a.json:  # every run as it ends
                        a.json.write_text(json.dumps({"numel": numel, "runs": runs}))
                    print(f"  H={h} {codec} seed {seed}: θ's loss {r['curve'][-1][2]:.4f} after {n} rounds, "
                          f"{r['up_per_island']:,.0f} B up / {r['down_per_island']:,.0f} B down an island a round, "
                          f"{r['seconds']:.0f} s", flush=True)  # fmt: skip
    report(runs, numel)


if __name__ == "__main__":
    main()
