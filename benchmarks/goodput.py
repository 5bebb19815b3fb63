"""Goodput under a chaos trace, with real processes: four outer-loop policies over the same wall budget.

    python benchmarks/goodput.py [--seconds 180] [--sync-every 100] [--policies barrier defaults sync decoupled]
                                 [--plot-dir benchmarks/plots]

One coordinator and four reference islands (``atoll island``, the tiny GPT on a synthetic corpus that it
cannot exhaust in the budget, see :func:`make_corpus`) at speeds
1, 1, 2 and 4 (islands C and D take 2x and 4x as long per inner step: the harness's ``slow`` fault),
each checkpointing at every push. The same chaos trace, by wall time, for every policy:

- island B is SIGKILLed every ``--kill-every`` seconds and restarted at once from its checkpoint;
- island C's network is cut for 20 s at 45 s (a proxy between it and the coordinator);
- island A's compute stalls for 15 s before its first round at or after round 6 (heartbeats go on).

``--calm``: none of the three, the islands at the same speeds (what the trace adds, e.g. to θ's loss
from one round to the next).

Policies (coordinator flags; islands follow the run's mode):

- barrier: quorum 4 and no grace: every round waits for every island (what torchft does);
- defaults: the defaults before this release: quorum 1, the deadline as the only limit of the wait
  (grace off), late deltas dropped;
- sync: today's sync defaults: quorum 1, adaptive grace window, late deltas folded (max staleness 4);
- decoupled: ``--outer-mode decoupled``, minimum quorum 2: islands never wait for the outer step.

Printed per policy, at the end of the budget, from the coordinator's ``/api/status``: the run's
goodput (island compute-seconds whose tokens entered θ over island wall-seconds while joined), each
island's blocked share of its time and tokens into θ, rounds closed, and the eval loss of the
coordinator's θ at that moment (the same held-out batches for every policy). Every snapshot is kept,
so ``--plot-dir`` plots the eval loss of θ after every round against wall time (since round 0
opened) and against the tokens that had entered θ (PNG).
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
import urllib.request
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)

from atoll.harness import ProcessGroup
from atoll.harness.faults import Fault, island_faults_json
from atoll.harness.wan import ProxyThread

SPEEDS = {"A": 1, "B": 1, "C": 2, "D": 4}
COMMON = ["--run-id", "gp", "--outer-lr", "1.0", "--outer-momentum", "0.5", "--lease-seconds", "10"]
COMMON += ["--codec", "identity", "--downlink-codec", "identity"]  # as its recorded figures were measured
POLICIES = {
    "barrier": ["--quorum", "4", "--grace-window", "off", "--late-policy", "drop", "--max-staleness", "1"],
    "defaults": ["--quorum", "1", "--grace-window", "off", "--late-policy", "drop", "--max-staleness", "1"],
    "sync": ["--quorum", "1"],
    "decoupled": ["--quorum", "2", "--outer-mode", "decoupled"],
}


VOCAB = 32
STREAMS = 1000
"""The synthetic corpora's independent streams."""


def make_corpus(path: Path, tokens: int = 4_000_000, seed: int = 0) -> Path:
    """A synthetic corpus that a few thousand inner steps cannot exhaust (the bundled text is 16 KB, which
    the tiny model overfits within a few hundred steps, so more training would read as a worse eval):
    an order-2 Markov source over 32 symbols, each context's next-symbol distribution drawn from
    Dirichlet(0.1), 1000 independent streams of 4000 tokens. uint16 ``.bin`` with its vocab sidecar.
    Alone on one core the tiny GPT takes its eval loss from 3.35 to 2.14 in 1200 steps of 16 x 64
    tokens, the drop starting after ~700 steps, and is still learning then."""
    import numpy as np

    rng = np.random.default_rng(seed)
    cum = rng.dirichlet(np.full(VOCAB, 0.1), size=VOCAB * VOCAB).cumsum(axis=1)
    a, b = rng.integers(VOCAB, size=STREAMS), rng.integers(VOCAB, size=STREAMS)
    return _write_chains(path, cum, np.arange(VOCAB * VOCAB), a * VOCAB + b, VOCAB, 2, tokens, rng)


def _write_chains(path: Path, cum, contexts, key, vocab: int, order: int, tokens: int, rng) -> Path:
    """Markov chains, one per entry of ``key`` (each a context: the ``order`` symbols before, base
    ``vocab``), ``tokens`` in all: each next symbol drawn from its context's row of ``cum``
    (cumulative distributions, row i for ``contexts[i]``, sorted). uint16 ``.bin`` and vocab sidecar."""
    import numpy as np

    out = np.empty((len(key), tokens // len(key)), dtype=np.uint16)
    for t in range(out.shape[1]):
        row = np.searchsorted(contexts, key)
        nxt = np.minimum((cum[row] < rng.random(len(key))[:, None]).sum(axis=1), vocab - 1)
        out[:, t] = nxt
        key = (key % vocab ** (order - 1)) * vocab + nxt
    out.tofile(path)
    path.with_name(path.name + ".json").write_text(json.dumps({"vocab_size": vocab}))
    return path


def make_text_corpus(path: Path, tokens: int = 4_000_000, order: int = 3, seed: int = 0) -> Path:
    """A text-like corpus that does not run out: characters drawn from the bundled text's own order-3
    statistics (each next character from the counts of what follows the 3 before it in the 16 KB
    text, read as a cycle so every context has a successor), 1000 independent streams. It reads like
    the bundled text (its 65 characters, its words, its speakers' names) but a run cannot memorise
    it: every window is new, so more training never reads as a worse held-out loss, and the loss the
    model can reach is the source's entropy rate (~1.0 nat per character), well under where a 45-s
    run ends. uint16 ``.bin`` with its vocab sidecar (the bundled text's vocabulary)."""
    import numpy as np

    from atoll.data.dataset import bundled_text

    text = bundled_text()
    chars = sorted(set(text))
    vocab = len(chars)
    ids = np.array([chars.index(c) for c in text], dtype=np.int64)
    cyc = np.concatenate([ids, ids[:order]])
    keys = np.zeros(len(ids), dtype=np.int64)
    for j in range(order):
        keys = keys * vocab + cyc[j : j + len(ids)]
    contexts, row_of = np.unique(keys, return_inverse=True)
    counts = np.zeros((len(contexts), vocab))
    np.add.at(counts, (row_of, cyc[order : order + len(ids)]), 1)
    cum = (counts / counts.sum(axis=1, keepdims=True)).cumsum(axis=1)
    rng = np.random.default_rng(seed)
    return _write_chains(path, cum, contexts, keys[rng.integers(len(ids), size=STREAMS)], vocab, order, tokens, rng)


def island_argv(name: str, address: str, work: Path) -> list[str]:
    return [
        "island",
        "--data",
        str(work.parent / "corpus.bin"),
        "--coordinator",
        address,
        "--island-id",
        name,
        "--run-id",
        "gp",
        "--inner-lr",
        "3e-3",
        "--heartbeat-seconds",
        "0.5",
        "--give-up-seconds",
        "300",
        "--checkpoint-dir",
        str(work / f"ckpt-{name}"),
        "--no-digest",
        "--eval-every-round" if name == "A" else "--no-eval-every-round",  # A is the probe
    ]


def faults_of(name: str, calm: bool = False) -> str:
    faults = []
    if SPEEDS[name] > 1:
        faults.append(Fault(island=name, round=0, kind="slow", factor=float(SPEEDS[name]), rounds=10**9))
    if name == "A" and not calm:
        faults.append(Fault(island="A", round=6, kind="stall", seconds=15.0))
    return island_faults_json(faults, name)


def status(admin_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/api/status", timeout=10) as resp:
        return json.loads(resp.read())


def run_policy(policy: str, a: argparse.Namespace, work: Path) -> dict:
    work.mkdir(parents=True)
    flags = [*COMMON, "--sync-every", str(a.sync_every), *POLICIES[policy], *a.coordinator_flags.split()]
    admin_file = work / "admin.port"
    flags += ["--admin-port", "0", "--admin-port-file", str(admin_file), "--keep-snapshots", "100000"]
    flags += ["--bulk-port", "-1"]  # C's link is the proxy of the gRPC port: a bulk port would go around it
    with ProcessGroup(work) as group:
        coord, address = group.start_coordinator(work / "state", flags)
        admin_port = int(admin_file.read_text())
        with ProxyThread(address) as proxy:
            procs = {}
            for name in SPEEDS:
                target = proxy.address if name == "C" else address
                procs[name] = group.start(name, island_argv(name, target, work), faults=faults_of(name, a.calm))
            t0 = time.monotonic()
            kills = [t0 + k * a.kill_every for k in range(1, int(a.seconds // a.kill_every) + 1)]
            cut_at, curve, restarts = t0 + 45.0, [], 0
            if a.calm:  # the same islands at the same speeds, and no fault
                kills, cut_at = [], None
            while (now := time.monotonic()) < t0 + a.seconds:
                if kills and now >= kills[0]:
                    kills.pop(0)
                    procs["B"].signal(signal.SIGKILL)
                    procs["B"].wait(10)
                    procs["B"] = group.start("B", island_argv("B", address, work), faults=faults_of("B"))
                    restarts += 1
                if cut_at is not None and now >= cut_at:
                    proxy.cut(20.0)
                    cut_at = None
                for name, p in procs.items():
                    ev = p.next_event(timeout=0.02)
                    if ev is not None and name == "A" and ev["event"] == "round" and ev.get("eval_loss") is not None:
                        curve.append((now - t0, ev["now_round"], ev["eval_loss"]))
                    if p.poll() is not None and name != "B":
                        raise RuntimeError(f"island {name} exited with {p.poll()}:\n{p.log_tail()}")
            got = status(admin_port)
            for p in procs.values():
                p.kill()
        coord.stop()
    from atoll.coordinator.disk import snapshots

    history = snapshots.load(work / "state").history  # the whole run's (/api/status has the last 100)
    tokens_by_round, total = {}, 0
    for h in history:
        total += h["tokens"]
        tokens_by_round[h["round"] + 1] = total
    rows = {r["island"]: r for r in got["islands"] if r.get("joined_seconds")}
    theta = evaluate_theta(work / "state")
    return {
        "policy": policy,
        "goodput": got["goodput"],
        "rounds": got["round"],
        "blocked": {n: rows[n]["blocked_seconds"] / rows[n]["joined_seconds"] for n in SPEEDS if n in rows},
        "island_goodput": {n: rows[n]["goodput"] for n in SPEEDS if n in rows},
        "tokens_into_theta": total,
        "late_folded": got["counters"].get("pushes_late_folded", 0),
        "late_dropped": got["counters"].get("pushes_late_dropped", 0),
        "restarts": restarts,
        "island_curve": [(t, tokens_by_round.get(r, 0), loss) for t, r, loss in curve],
        "curve": theta,
        "eval_loss": theta[-1][2],
        "history": [  # what each round was made of (with --coordinator-flags="--snapshot-every 1", beside "curve")
            {
                k: h.get(k)
                for k in ("round", "islands", "late", "too_stale", "steps_by_island", "tokens_by_island", "share")
            }  # fmt: skip
            for h in history
        ],
    }


def evaluate_theta(state_dir: Path, data: str | None = None) -> list[tuple[float, int, float]]:
    """The held-out loss of the coordinator's θ after every round (every snapshot is kept), with the
    wall seconds since round 0 opened (the rounds' open, save and publish times summed) and the tokens
    that had entered θ: [(seconds, tokens, eval loss)], θ_0 first."""
    from atoll.coordinator.disk import snapshots
    from atoll.models import PRESETS
    from atoll.workload.island import IslandArgs, build_model, evaluate, load_data

    corpus = str(state_dir.parent.parent / "corpus.bin") if data is None else data  # "": the bundled text
    args = IslandArgs(coordinator="-", island_id="eval", data=corpus)
    data = load_data(args, args.block_size or PRESETS[args.model]["block_size"])
    model = build_model(args, data.vocab_size)
    params = {n for n, _ in model.named_parameters()}
    out = []
    for path in snapshots.snapshot_paths(state_dir):
        snap = snapshots.verify(path)
        missing, unexpected = model.load_state_dict(snap.params, strict=False)
        if unexpected or params & set(missing):
            raise RuntimeError(f"the run's θ does not fit the model: missing {missing}, unexpected {unexpected}")
        h = snap.history
        seconds = sum(r["seconds_open"] + r.get("persist_seconds", 0) + r.get("publish_seconds", 0) for r in h)
        out.append((seconds, sum(r["tokens"] for r in h), evaluate(model, data)))
    return out


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        t, tokens, loss = zip(*r["curve"], strict=True) if r["curve"] else ((), (), ())
        axes[0].plot(t, loss, marker=".", label=f"{r['policy']} (goodput {r['goodput']:.2f})")
        axes[1].plot(tokens, loss, marker=".", label=r["policy"])
    axes[0].set(
        xlabel="wall seconds since round 0 opened", ylabel="eval loss of θ", title="eval loss against wall time"
    )
    axes[1].set(xlabel="tokens into θ", ylabel="eval loss of θ", title="eval loss against tokens")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=180.0, help="wall budget of each policy")
    p.add_argument("--sync-every", type=int, default=100, help="H")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between SIGKILLs of island B")
    p.add_argument(
        "--calm", action="store_true", help="no kill, cut or stall: the islands at their speeds (what the trace adds)"
    )
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--plot-dir", type=Path, default=None)
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="write every figure and curve here")
    p.add_argument(
        "--coordinator-flags",
        default="",
        help='more coordinator flags for every policy, e.g. "--snapshot-every 1" (θ\'s loss after every round)',
    )
    a = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="atoll-goodput-") as tmp:
        root = a.work_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        make_corpus(root / "corpus.bin")
        for policy in a.policies:
            r = run_policy(policy, a, root / policy)
            results.append(r)
            blocked = " ".join(f"{n} {v:.0%}" for n, v in r["blocked"].items())
            per = " ".join(f"{n} {v:.2f}" for n, v in r["island_goodput"].items())
            print(
                f"{policy:>10}: goodput {r['goodput']:.3f} [{per}], blocked [{blocked}], tokens into θ "
                f"{r['tokens_into_theta']:,d}, rounds {r['rounds']}, folded {r['late_folded']}, dropped "
                f"{r['late_dropped']}, B restarts {r['restarts']}, eval loss {r['eval_loss']:.4f}",
                flush=True,
            )
    if a.json is not None:
        a.json.write_text(json.dumps(results, indent=1))
    if a.plot_dir is not None:
        plot(results, a.plot_dir / "goodput.png")
        print(f"plot: {a.plot_dir / 'goodput.png'}")


if __name__ == "__main__":
    main()
