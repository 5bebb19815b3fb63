"""``atoll plan``'s flags and output (the model is :mod:`atoll.plan`)."""

from __future__ import annotations

import argparse
import json
import math

from atoll.plan import CODEC_ORDER, Link, plan

DEFAULT_CODECS = ["identity", "int8", "int4", "sparse", "dcttopk"]
DEFAULT_H = [30, 100, 250, 500, 1000]
VOCAB = {"tiny": 65, "gpt-small": 65, "gpt-125m": 50257}


def add_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", choices=sorted(VOCAB), help="a bundled model preset")
    model.add_argument("--params", type=float, help="a model of this many parameters (e.g. 1e9)")
    p.add_argument("--step-seconds", type=float, required=True, help="one inner step on an island (required)")
    p.add_argument("--islands", type=int, default=2, help="islands in the run (default: 2)")
    p.add_argument("--bandwidth-mbit", type=float, required=True, help="each island's link, Mbit/s (required)")
    p.add_argument("--rtt-ms", type=float, required=True, help="its round trip to the coordinator (required)")
    p.add_argument("--loss", type=float, default=0.0, help="packet loss probability on it (default: 0)")
    p.add_argument("--mtu", type=int, default=1500, help="the link's MTU (default: 1500)")
    p.add_argument(
        "--coordinator-mbit",
        type=float,
        default=None,
        help="the coordinator's own link, shared by all (default: ample)",
    )
    p.add_argument(
        "--relays",
        type=int,
        default=0,
        help="the islands sit behind this many relays (atoll relay), evenly: --bandwidth-mbit and --rtt-ms are then "
        "each relay's link to the coordinator (default: 0, islands reach it themselves)",
    )
    p.add_argument(
        "--site-mbit", type=float, default=10_000.0, help="with --relays: the islands' link to their relay (10000)"
    )
    p.add_argument("--site-rtt-ms", type=float, default=0.5, help="with --relays: its round trip (default: 0.5)")
    p.add_argument("--no-tls", action="store_true", help="plaintext (default: TLS, one more round trip a call)")
    p.add_argument(
        "--fresh-connections",
        action="store_true",
        help="every call opens its connections and starts in slow start (default: kept from the round before)",
    )
    p.add_argument("--sync-every", type=int, nargs="+", default=None, help=f"H candidates (default: {DEFAULT_H})")
    p.add_argument("--codec", nargs="+", default=None, help=f"codec candidates (default: {DEFAULT_CODECS})")
    p.add_argument(
        "--overlap", choices=["off", "on", "both"], default="both", help="overlap the exchange (default: both)"
    )
    p.add_argument(
        "--fragments", type=int, nargs="+", default=[1, 4], help="streaming fragments P (1: off; default: 1 4)"
    )
    p.add_argument(
        "--outer-seconds",
        type=float,
        default=None,
        help="the coordinator's outer step, seconds (default: 5.7 ns/param, one CPU thread; a running "
        "coordinator's outer_step_seconds in /api/status's history)",
    )
    p.add_argument(
        "--decode-seconds",
        type=float,
        default=None,
        help="the coordinator's decoding of one island's push, seconds (default: per codec, 0.6-6.5 ns/param "
        "on one CPU thread; a running coordinator's decode_seconds, per round, over the islands)",
    )
    p.add_argument(
        "--host-seconds",
        type=float,
        default=0.0,
        help="the island's own work per round on its training thread, not hidden by overlap (default: 0, an "
        "accelerator's; a CPU island's RoundStats.host_seconds, the 'own work' of atoll island's round lines)",
    )
    p.add_argument(
        "--background-seconds",
        type=float,
        default=0.0,
        help="the island's own work per round on its exchange's thread, hidden with the exchange by overlap "
        "(default: 0; RoundStats.background_seconds, the 'own work on its thread' of atoll island's round lines)",
    )
    p.add_argument(
        "--max-overlap", type=float, default=0.5, help="the most of H an update may arrive late by (default: 0.5)"
    )
    p.add_argument("--target", type=float, default=0.97, help="the utilisation to reach (default: 0.97)")
    p.add_argument("--json", action="store_true", help="print JSON: a list of candidates, the recommended first")


def shapes_of(ns) -> list[tuple[int, ...]]:
    if ns.params is not None:
        return [(int(ns.params),)]
    import torch

    from atoll.models import TinyGPT, preset

    with torch.device("meta"):
        model = TinyGPT(preset(ns.model, vocab_size=VOCAB[ns.model]))
    return [tuple(p.shape) for p in model.parameters()]


RANGES = {
    "params": (1.0, 1e13, "a model's parameters"),
    "step_seconds": (1e-6, 1e5, "seconds"),
    "islands": (1, 100_000, "islands"),
    "bandwidth_mbit": (1e-3, 1e7, "Mbit/s"),
    "rtt_ms": (0.0, 1e5, "ms"),
    "mtu": (576, 65535, "bytes"),
    "coordinator_mbit": (1e-3, 1e8, "Mbit/s"),
    "relays": (0, 100_000, "relays"),
    "site_mbit": (1e-3, 1e7, "Mbit/s"),
    "site_rtt_ms": (0.0, 1e5, "ms"),
    "outer_seconds": (0.0, 1e5, "seconds"),
    "decode_seconds": (0.0, 1e5, "seconds"),
    "host_seconds": (0.0, 1e5, "seconds"),
    "background_seconds": (0.0, 1e5, "seconds"),
    "max_overlap": (0.0, 1.0, "a share of H"),
    "sync_every": (1, 10_000_000, "inner steps"),
    "fragments": (1, 1024, "fragments"),
}
"""Each numeric flag's range (both ends included), checked before anything is computed: a value outside
it (inf, nan, a negative time) is one line naming the flag."""


def check(ns) -> None:
    """ValueError naming the flag for a value outside its range (:data:`RANGES`), a loss outside [0, 1) or
    a target outside (0, 1]."""
    for name, (low, high, unit) in RANGES.items():
        value = getattr(ns, name)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not (low <= v <= high):  # (False for nan)
                raise ValueError(f"--{name.replace('_', '-')} must be in {low:g}..{high:g} ({unit}), got {v:g}")
    if not 0 <= ns.loss < 1:
        raise ValueError(f"--loss is a probability in [0, 1), got {ns.loss:g}")
    if not 0 < ns.target <= 1:
        raise ValueError(f"--target is a share of wall time in (0, 1], got {ns.target:g}")


OVERLAP_NOTE = (
    "Overlap (τ > 0) assumes the island's host CPU is free while it computes: with its CPU loaded a run "
    "measured 60.8% against 80.5% planned with overlap, and 56.9% against 57.4% without."
)


def reason(best, target: float) -> str:
    """Why the recommended row is the one (the rule of :func:`atoll.plan.plan`), in words."""
    if best.utilisation < target:
        return f"nothing reaches {target:.0%}: the best utilisation"
    return (
        f"reaches {target:.0%} with the least lossy codec ({best.codec}), then the smallest H ({best.sync_every}), "
        f"then the least overlap (τ {best.overlap_steps}), then the fewest fragments ({best.fragments})"
    )


def table(got, ns) -> list[str]:
    """One row per codec, H and fragments: the plain exchange's utilisation beside the overlapped one's
    (with overlap every row may read 100%: the plain figure is what a busy host gets), the recommended
    row marked."""
    rows: dict[tuple, dict] = {}
    for e in got:  # the recommended first, then by utilisation
        rows.setdefault((e.codec, e.downlink_codec, e.sync_every, e.fragments), {})[e.overlap_steps > 0] = e
    down = max(8, *(len(e.downlink_codec) for e in got))
    lines = [
        f"{'codec':>8} {'down':>{down}} {'H':>5} {'P':>2} {'up MB':>8} {'down MB':>8} {'sync s':>7} {'(coord)':>7} "
        f"{'plain':>6} {'τ':>4} {'overlap':>7}"
    ]
    best = got[0]
    for pair in list(rows.values())[:20]:
        plain, over = pair.get(False), pair.get(True)
        e = plain or over
        cells = [
            f"{e.codec:>8} {e.downlink_codec:>{down}} {e.sync_every:>5} {e.fragments:>2}",
            f"{e.bytes_up_per_round / 1e6:>8.1f} {e.bytes_down_per_round / 1e6:>8.1f}",
            f"{e.sync_seconds:>7.2f} {e.coordinator_seconds:>7.2f}",
            f"{plain.utilisation:>6.1%}" if plain else f"{'-':>6}",
            f"{over.overlap_steps:>4} {over.utilisation:>7.1%}" if over else f"{'-':>4} {'-':>7}",
        ]
        mark = ""
        if best in pair.values():
            mark = f"  <- recommended ({'overlapped' if best.overlap_steps else 'plain'})"
        lines.append(" ".join(cells) + mark)
    return lines


def run(ns) -> int:
    from atoll.compression import get_codec

    codecs = ns.codec or DEFAULT_CODECS
    for c in codecs:
        get_codec(c)  # ValueError naming the codec
    check(ns)
    link = Link(
        rate_mbit=ns.bandwidth_mbit,
        rtt_ms=ns.rtt_ms,
        loss=ns.loss,
        mtu=ns.mtu,
        tls=not ns.no_tls,
        kept=not ns.fresh_connections,
    )
    overlap = {"off": [False], "on": [True], "both": [False, True]}[ns.overlap]
    if ns.relays > ns.islands:
        raise ValueError(f"--relays {ns.relays} is more than the --islands {ns.islands} behind them")
    if ns.relays and ns.fragments != [1]:
        ns.fragments = [1]  # a relay serves an unfragmented run (streaming fragments reach the root alone)
    site = Link(rate_mbit=ns.site_mbit, rtt_ms=ns.site_rtt_ms, tls=not ns.no_tls, kept=not ns.fresh_connections)
    shapes = shapes_of(ns)
    got = plan(
        shapes=shapes,
        step_seconds=ns.step_seconds,
        islands=ns.islands,
        link=link,
        codecs=sorted(codecs, key=lambda c: CODEC_ORDER.index(c) if c in CODEC_ORDER else 99),
        sync_every=ns.sync_every or DEFAULT_H,
        overlap=overlap,
        fragments=ns.fragments,
        outer_seconds=ns.outer_seconds,
        decode_seconds=ns.decode_seconds,
        host_seconds=ns.host_seconds,
        background_seconds=ns.background_seconds,
        coordinator_mbit=ns.coordinator_mbit,
        relays=ns.relays,
        site=site,
        target=ns.target,
        max_overlap=ns.max_overlap,
    )
    if not got:
        raise ValueError("no candidate: every H is below twice its fragments")
    if ns.json:
        print(json.dumps([e.as_dict() for e in got], indent=1))
        return 0
    params = sum(math.prod(s) for s in shapes)
    print(
        f"{params / 1e6:.1f}M parameters, {ns.islands} islands"
        f"{f' behind {ns.relays} relays ({ns.site_mbit:g} Mbit/s to them)' if ns.relays else ''}, "
        f"{ns.step_seconds:g} s a step; each {'relay' if ns.relays else 'island'}'s link "
        f"{ns.bandwidth_mbit:g} Mbit/s, {ns.rtt_ms:g} ms{f', loss {ns.loss:g}' if ns.loss else ''}"
        f"{'' if link.tls else ', no TLS'}; {got[0].streams} TCP stream(s) a transfer"
    )
    print("utilisation: the share of wall time the accelerators compute, with a plain exchange and overlapped")
    for line in table(got, ns):
        print(line)
    best = got[0]
    flags = f"--codec {best.codec} --downlink-codec {best.downlink_codec} --sync-every {best.sync_every}"
    flags += " --error-feedback" if get_codec(best.codec).drops_values else ""
    flags += f" --fragments {best.fragments}" if best.fragments > 1 else ""
    island = f" --overlap-steps {best.overlap_steps}" if best.overlap_steps else ""
    island += " --streaming" if best.fragments > 1 else ""
    print(f"\nrecommended: {reason(best, ns.target)}")
    print(f"  atoll coordinator {flags}; atoll island{island or ' (defaults)'}")
    if any(e.overlap_steps for e in got):
        print(f"\n{OVERLAP_NOTE}")
    return 0
