"""The quality map: θ's eval loss at equal wall time and at equal tokens, per outer-loop policy, with
islands of different speeds.

    python benchmarks/quality_map.py [--speeds 1,1,4] [--sync-every 10 50] [--policies barrier sync decoupled]
        [--quorum 1 half] [--seeds 0 1 2] [--seconds 45] [--json out.json] [--plot-dir benchmarks/plots]

One coordinator and one reference island (``atoll island``, the tiny GPT on the bundled text; with
``--data text`` on text drawn from the bundled text's order-3 statistics, which a run cannot memorise
(goodput.py's ``make_text_corpus``); with ``--data synthetic`` on goodput.py's Markov corpus, which
a short run barely starts to learn)
per entry of ``--speeds``; an island of speed k takes k times as long per inner step (the
harness's ``slow`` fault). No other fault: this maps the policies, not the chaos (goodput.py has that).
Policies (coordinator flags):

- barrier: every round waits for every island (quorum = the islands, no grace, late deltas dropped);
- sync: sync mode with the quorum below (``--quorum``), its adaptive grace window, late deltas folded;
- decoupled: ``--outer-mode decoupled`` with the quorum below and the default rule for a round of
  some islands (``--decoupled-step spread`` since RESULTS.md's "a round of many rounds' work spread";
  ``even`` since "the held-back momentum"; ``progress``
  since the map with round 0's grace capped; ``whole``, ``delayed`` and ``share`` before), its
  islands pushing together (the default since `e8af10f`);
- decoupled-share: ``--decoupled-step share`` (a round of some islands steps by its share of a full
  round, the outer momentum applied at every round);
- decoupled-full: ``--decoupled-step full`` (every round steps as far as a round of everyone: the
  rule before the map);
- decoupled-delayed: ``--decoupled-step delayed`` (steps by share, the outer momentum applied once
  per full round's share: Delayed Nesterov).
- decoupled-whole: ``--decoupled-step whole`` (delayed, with a delta of n > H inner steps entering
  whole rather than scaled by H/n, its island's usual weight its weight per H steps).
- decoupled-progress: ``--decoupled-step progress`` (each island's progress since its last push enters
  as its share of a round of everyone, a long delta once; rounds adding up to S full rounds' work step
  the momentum as S rounds of their mean gradient would).
- decoupled-even: ``--decoupled-step even`` (as progress, with every round stepping the momentum as its
  own share of a full round, whatever the share, instead of holding it until the shares add up to one).
- decoupled-spread: ``--decoupled-step spread`` (as even, a round stepping at most 1.5x the usual
  share and the rest of its work joining the rounds after).
- decoupled-dylu: decoupled (the default rule) with step counts from the islands' speeds (DyLU, Liu
  et al. 2024): every island syncs on a time budget of H full-speed steps (``atoll island
  --sync-every-seconds``, H x ``--step-seconds``), so a slow island pushes a shorter delta as often as
  the fast ones rather than an H-step delta several rounds stale.
- decoupled-unaligned: decoupled with islands that push every H steps (``atoll island
  --no-align-pushes``), as before the coordinator told them where their pushes landed.
- decoupled-wait0, -wait10, -wait20, -wait30, -wait40: decoupled with islands that, after a push, wait for its
  update up to 0, 0.1, 0.2, 0.3 or 0.4 times the compute time of the push's steps (``atoll island
  --update-wait``; 0.2, the default, is plain ``decoupled``; 0 never waits, as before).
- sync-overlap5, sync-overlap15: sync, the islands with ``--overlap-steps`` 5 or 15 (they train that
  many steps on the old θ while the exchange is out, then wait for it).

``--quorum``: 1, or ``half`` (half the islands, rounded up); barrier ignores it. Each (policy, quorum,
H, seed) is one run of ``--seconds`` of wall time; the seed sets θ_0 and every island's data order.
Every snapshot is kept, so θ's held-out loss is known after every round: printed per configuration,
the mean and the spread (min-max) over seeds of the eval loss of θ at the end of the budget (equal wall
time) and at the token count every run of that H reached (equal tokens: θ's loss interpolated between the
rounds on either side),
and the tokens into θ. ``--json`` keeps every curve; ``--plot-dir`` draws loss against wall time and
against tokens per H. ``--against sync`` adds every other policy's gap to sync at equal tokens, every
0.5M tokens, seed by seed (sync's curve for the same seed); ``--pool A.json B.json`` runs nothing and
reads the runs of earlier ``--json`` files together (seeds from several runs of the map).
``--relays R``: the islands sit behind R relays (``atoll relay``, island i behind relay i mod R), each
policy named ``POLICY+relaysR`` (pool it with a run without relays and ``--against POLICY``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)
from goodput import evaluate_theta, make_corpus, make_text_corpus  # benchmarks/goodput.py, beside this

from atoll.coordinator.disk import snapshots
from atoll.harness import ProcessGroup
from atoll.harness.faults import Fault, island_faults_json

COMMON = ["--run-id", "gp", "--outer-lr", "1.0", "--outer-momentum", "0.5", "--lease-seconds", "10"]
COMMON += ["--codec", "identity", "--downlink-codec", "identity", "--bulk-port", "-1"]


def policy_flags(policy: str, quorum: int, islands: int) -> list[str]:
    if policy == "barrier":
        return ["--quorum", str(islands), "--grace-window", "off", "--late-policy", "drop", "--max-staleness", "1"]
    if policy.startswith("sync"):
        return ["--quorum", str(quorum)]
    decoupled = ["--quorum", str(quorum), "--outer-mode", "decoupled"]
    step = policy.removeprefix("decoupled").removeprefix("-")  # "" for the default rule
    return decoupled + (
        ["--decoupled-step", step] if step and step not in ("dylu", "unaligned") and not step.startswith("wait") else []
    )


def island_argv(name: str, address: str, work: Path, seed: int, data: str, budget: float | None) -> list[str]:
    corpus = ["--data", str(work.parent / "corpus.bin")] if data != "bundled" else []
    corpus += ["--sync-every-seconds", f"{budget:g}"] if budget else []
    return [
        "island", *corpus, "--coordinator", address, "--island-id", name,
        "--run-id", "gp", "--inner-lr", "3e-3", "--heartbeat-seconds", "0.5", "--give-up-seconds", "300",
        "--no-digest", "--no-eval-every-round", "--seed", str(seed), "--data-seed", str(1000 * seed + ord(name)),
    ]  # fmt: skip


def run(policy: str, quorum: int, h: int, seed: int, speeds: list[float], a, work: Path) -> dict:
    work.mkdir(parents=True)
    names = [chr(ord("A") + i) for i in range(len(speeds))]
    # (the root's quorum counts islands, those behind relays too)
    flags = [*COMMON, "--sync-every", str(h), *policy_flags(policy, quorum, len(speeds)), *a.coordinator_flags.split()]
    flags += ["--keep-snapshots", "100000", "--snapshot-every", "1"]
    with ProcessGroup(work) as group:
        coord, address = group.start_coordinator(work / "state", flags)
        relays = [relay_address(group, address, k, work, a.relay_grace) for k in range(a.relays)]
        procs = []
        for i, (name, speed) in enumerate(zip(names, speeds, strict=True)):
            faults = []
            if speed != 1:
                faults.append(Fault(island=name, round=0, kind="slow", factor=float(speed), rounds=10**9))
            procs.append(
                group.start(
                    name,
                    island_argv(
                        name,
                        relays[i % len(relays)] if relays else address,
                        work,
                        seed,
                        a.data,
                        h * a.step_seconds if policy.endswith("dylu") else None,
                    )
                    + (["--overlap-steps", policy.removeprefix("sync-overlap")] if "overlap" in policy else [])
                    + (["--no-align-pushes"] if policy.endswith("unaligned") else [])
                    + (["--update-wait", f"{int(policy.split('-wait')[1]) / 100:g}"] if "-wait" in policy else []),
                    faults=island_faults_json(faults, name),
                )
            )
        deadline = time.monotonic() + a.seconds
        while time.monotonic() < deadline:
            for p in procs:
                p.next_event(timeout=0.05)
                if p.poll() is not None:
                    raise RuntimeError(f"an island exited with {p.poll()}:\n{p.log_tail()}")
        for p in procs:
            p.kill()
        coord.stop()
    curve = evaluate_theta(work / "state", None if a.data != "bundled" else "")
    history = snapshots.load(work / "state").history
    carried = sum(len(r.get("too_stale") or ()) for r in history)  # pushes refused as too stale, work carried
    rounds = [
        {"islands": r.get("islands", []), "late": r.get("late", []), "steps": r.get("steps_by_island", {})}
        for r in history
    ]  # who entered each round, and with how many inner steps
    label = f"{policy}+relays{a.relays}" + (f"-grace{a.relay_grace}" if a.relay_grace else "")
    return {
        "policy": label if a.relays else policy,
        "quorum": quorum, "sync_every": h, "seed": seed, "curve": curve, "carried": carried,
        "rounds": rounds,
    }  # fmt: skip


def relay_address(group, root: str, k: int, work: Path, grace_window: str | None = None) -> str:
    """Relay ``k`` (``atoll relay``) in front of the root: its address once it listens."""
    port_file = work / f"relay-{k}.port"
    flags = ["--grace-window", grace_window] if grace_window is not None else []
    proc = group.start(f"relay-{k}", ["relay", "--upstream", root, "--run-id", "gp", "--relay-id", f"relay-{k}",
                                      "--bulk-port", "-1", "--port-file", str(port_file), *flags])  # fmt: skip
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"relay {k} reported no port:\n{proc.log_tail()}")
        time.sleep(0.05)
    return f"127.0.0.1:{port_file.read_text().strip()}"


def loss_at_tokens(curve, tokens: int) -> float:
    """θ's loss at ``tokens`` tokens into θ, linear between the rounds on either side. (Before: the
    loss after the last round at or below, up to a round's tokens earlier; decoupled rounds, which
    carry more tokens than H-step ones, were read further back, where the loss falls fast.)"""
    import numpy as np

    return float(np.interp(tokens, [t for _, t, _ in curve], [loss for _, _, loss in curve]))


def summary(runs: list[dict]) -> list[dict]:
    out = []
    for h in sorted({r["sync_every"] for r in runs}):
        of_h = [r for r in runs if r["sync_every"] == h]
        equal_tokens = min(r["curve"][-1][1] for r in of_h)  # every run of this H reached it
        for key in sorted({(r["policy"], r["quorum"]) for r in of_h}):
            group = [r for r in of_h if (r["policy"], r["quorum"]) == key]
            wall = [r["curve"][-1][2] for r in group]
            tok = [loss_at_tokens(r["curve"], equal_tokens) for r in group]
            tokens = [r["curve"][-1][1] for r in group]
            out.append(
                {
                    "sync_every": h, "policy": key[0], "quorum": key[1], "seeds": len(group),
                    "loss_wall": statistics.mean(wall), "loss_wall_range": (min(wall), max(wall)),
                    "equal_tokens": equal_tokens, "loss_tokens": statistics.mean(tok),
                    "loss_tokens_range": (min(tok), max(tok)), "tokens": statistics.mean(tokens),
                }
            )  # fmt: skip
    return out


GAP_WINDOW = 250_000
"""Half the token window of a smoothed gap: θ's loss averaged over tokens ± this (at H=10 θ's loss moves
by ±2-3% from one round to the next, sync's as well, so one point compares the two curves' wobbles)."""


def gaps(runs: list[dict], base: str, h: int, quorum: int) -> tuple[list[float], dict[str, dict[str, list]]]:
    """Every other policy of (``h``, ``quorum``) against ``base``, seed by seed where both ran, at
    every 0.5M tokens all those runs reached (less the window): the token counts, and per policy
    ``{"point": [...], "window": [...], "seeds": n}``, each entry the gap of the seeds' mean losses in
    percent (+: behind ``base``); "window" averages each curve over ``GAP_WINDOW`` either side."""
    import numpy as np

    def windowed(curve, t):
        around = np.linspace(t - GAP_WINDOW, t + GAP_WINDOW, 51)
        return float(np.mean(np.interp(around, [n for _, n, _ in curve], [loss for _, _, loss in curve])))

    of = [r for r in runs if r["sync_every"] == h and r["quorum"] == quorum]
    by_seed = {r["seed"]: r for r in of if r["policy"] == base}
    out, reach = {}, []
    for policy in sorted({r["policy"] for r in of} - {base}):
        pairs = [(by_seed[r["seed"]], r) for r in of if r["policy"] == policy and r["seed"] in by_seed]
        if pairs:
            out[policy] = pairs
            reach += [min(b["curve"][-1][1], o["curve"][-1][1]) for b, o in pairs]
    points = [t * 500_000 for t in range(1, 40) if reach and t * 500_000 + GAP_WINDOW <= min(reach)]
    table = {}
    for policy, pairs in out.items():
        table[policy] = {"seeds": len(pairs)}
        for name, at in (("point", loss_at_tokens), ("window", windowed)):
            base_mean, other_mean = (
                [statistics.mean(at(r["curve"], t) for r in side) for t in points] for side in zip(*pairs, strict=True)
            )
            table[policy][name] = [100.0 * (o / b - 1.0) for b, o in zip(base_mean, other_mean, strict=True)]
    return points, table


def print_gaps(runs: list[dict], base: str) -> None:
    for h, quorum in sorted({(r["sync_every"], r["quorum"]) for r in runs}):
        points, table = gaps(runs, base, h, quorum)
        if not table or not points:
            continue
        print(f"H={h} quorum {quorum}, against {base} at equal tokens (mean of the seeds; +: behind)")
        print(f"  {'tokens (M)':<38}" + "".join(f"{t / 1e6:>7.1f}" for t in points))
        for policy, row in table.items():
            for name in ("point", "window"):
                label = f"{policy} ({row['seeds']} seeds), {name}"
                print(f"  {label:<38}" + "".join(f"{g:>+6.1f}%" for g in row[name]), flush=True)


def print_summary(rows: list[dict]) -> None:
    print("H   policy            quorum  loss at equal wall (range)     loss at equal tokens (range)   tokens into θ")
    for s in rows:
        print(
            f"{s['sync_every']:<4}{s['policy']:<18}{s['quorum']:<8}{s['loss_wall']:.4f} "
            f"({s['loss_wall_range'][0]:.4f}-{s['loss_wall_range'][1]:.4f})      {s['loss_tokens']:.4f} "
            f"({s['loss_tokens_range'][0]:.4f}-{s['loss_tokens_range'][1]:.4f}) at {s['equal_tokens']:,}   "
            f"{s['tokens']:,.0f}",
            flush=True,
        )


def plot(runs: list[dict], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    for h in sorted({r["sync_every"] for r in runs}):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        colours = {}
        for r in (r for r in runs if r["sync_every"] == h):
            key = f"{r['policy']} q{r['quorum']}"
            colour = colours.setdefault(key, f"C{len(colours)}")
            t, tokens, loss = zip(*r["curve"], strict=True)
            label = key if r["seed"] == min(x["seed"] for x in runs) else None
            axes[0].plot(t, loss, color=colour, alpha=0.7, label=label)
            axes[1].plot(tokens, loss, color=colour, alpha=0.7, label=label)
        axes[0].set(xlabel="wall seconds since round 0 opened", ylabel="eval loss of θ", title=f"H={h}: wall time")
        axes[1].set(xlabel="tokens into θ", ylabel="eval loss of θ", title=f"H={h}: tokens")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / f"quality-map-h{h}.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--speeds", default="1,1,4", help="each island's slowness, comma-separated (1: full speed)")
    p.add_argument("--sync-every", type=int, nargs="+", default=[10, 50])
    p.add_argument(
        "--policies",
        nargs="+",
        default=["barrier", "sync", "decoupled"],
        choices=[
            "barrier",
            "sync",
            "decoupled",
            "decoupled-share",
            "decoupled-full",
            "decoupled-delayed",
            "decoupled-dylu",
            "decoupled-whole",
            "decoupled-progress",
            "decoupled-even",
            "decoupled-spread",
            "decoupled-unaligned",
            "decoupled-wait0",
            "decoupled-wait10",
            "decoupled-wait20",
            "decoupled-wait30",
            "decoupled-wait40",
            "sync-overlap5",
            "sync-overlap15",
        ],
    )
    p.add_argument(
        "--step-seconds",
        type=float,
        default=0.0224,
        help="decoupled-dylu: a full-speed island's inner step (0.0224 s: 3 islands at 1:1:4 on this 2-core "
        "machine, decoupled); every island syncs after H times this many seconds",
    )
    p.add_argument("--quorum", nargs="+", default=["1"], help="1 and/or half")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seconds", type=float, default=45.0, help="wall budget of each run")
    p.add_argument(
        "--data",
        choices=["bundled", "text", "synthetic"],
        default="bundled",
        help="bundled: the 16 KB text (memorised within a run); text: drawn from its order-3 statistics, "
        "lasting (make_text_corpus); synthetic: goodput.py's Markov source",
    )
    p.add_argument(
        "--coordinator-flags", default="", help="more coordinator flags for every run (the last of a flag wins)"
    )
    p.add_argument("--relays", type=int, default=0, help="put the islands behind this many relays (0: none)")
    p.add_argument("--relay-grace", default=None, help="the relays' --grace-window (0: forward what has arrived)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot-dir", type=Path, default=None)
    p.add_argument(
        "--against",
        default=None,
        help="a policy: print every other policy's gap to it at equal tokens, every 0.5M, seed by seed "
        "(point and smoothed over ±0.25M tokens)",
    )
    p.add_argument(
        "--pool", type=Path, nargs="+", default=None, help="run nothing: the runs of these --json files, together"
    )
    a = p.parse_args()
    if a.pool:
        runs = [r for f in a.pool for r in json.loads(f.read_text())["runs"]]
        print_summary(summary(runs))
        if a.against:
            print_gaps(runs, a.against)
        return
    speeds = [float(s) for s in a.speeds.split(",")]
    quorums = sorted({1 if q == "1" else math.ceil(len(speeds) / 2) for q in a.quorum})
    print(f"islands at speeds {speeds}, {a.seconds:g} s each, seeds {a.seeds} {a.coordinator_flags}", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="qmap-") as tmp:
        if a.data == "synthetic":
            make_corpus(Path(tmp) / "corpus.bin")
        elif a.data == "text":
            make_text_corpus(Path(tmp) / "corpus.bin")
        for h in a.sync_every:
            for policy in a.policies:
                for quorum in [len(speeds)] if policy == "barrier" else quorums:
                    for seed in a.seeds:
                        work = Path(tmp) / f"{policy}-q{quorum}-h{h}-s{seed}"
                        r = run(policy, quorum, h, seed, speeds, a, work)
                        runs.append(r)
                        if a.json:  # every run as it ends (a later failure loses nothing)
                            a.json.write_text(json.dumps({"speeds": speeds, "runs": runs}))
                        _, tokens, loss = r["curve"][-1]
                        print(f"  H={h} {policy} quorum {quorum} seed {seed}: θ's loss {loss:.4f} at the end, "
                              f"{tokens:,} tokens into θ, {len(r['curve']) - 1} rounds", flush=True)  # fmt: skip
    rows = summary(runs)
    print_summary(rows)
    if a.against:
        print_gaps(runs, a.against)
    if a.json:
        a.json.write_text(json.dumps({"speeds": speeds, "runs": runs, "summary": rows}))
    if a.plot_dir:
        plot(runs, a.plot_dir)


if __name__ == "__main__":
    main()
