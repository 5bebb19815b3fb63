"""``atoll plan``'s flags and output (the model is :mod:`atoll.plan`)."""

from __future__ import annotations

import argparse
import json
import math

from atoll.plan import CODEC_ORDER, Link, plan

DEFAULT_CODECS = ["identity", "int8", "int4", "dcttopk"]
DEFAULT_H = [100, 250, 500, 1000]
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
        "--max-overlap", type=float, default=0.5, help="the most of H an update may arrive late by (default: 0.5)"
    )
    p.add_argument("--target", type=float, default=0.97, help="the utilisation to reach (default: 0.97)")
    p.add_argument("--json", action="store_true", help="print JSON: a list of candidates, the recommended first")


def shapes_of(ns) -> list[tuple[int, ...]]:
    if ns.params is not None:
        if ns.params < 1:
            raise ValueError("--params must be at least 1")
        return [(int(ns.params),)]
    import torch

    from atoll.models import TinyGPT, preset

    with torch.device("meta"):
        model = TinyGPT(preset(ns.model, vocab_size=VOCAB[ns.model]))
    return [tuple(p.shape) for p in model.parameters()]


def run(ns) -> int:
    from atoll.compression import get_codec

    codecs = ns.codec or DEFAULT_CODECS
    for c in codecs:
        get_codec(c)  # ValueError naming the codec
    if ns.step_seconds <= 0 or ns.islands < 1 or any(p < 1 for p in ns.fragments):
        raise ValueError("need --step-seconds > 0, --islands >= 1 and --fragments >= 1")
    link = Link(
        rate_mbit=ns.bandwidth_mbit,
        rtt_ms=ns.rtt_ms,
        loss=ns.loss,
        mtu=ns.mtu,
        tls=not ns.no_tls,
        kept=not ns.fresh_connections,
    )
    overlap = {"off": [False], "on": [True], "both": [False, True]}[ns.overlap]
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
        coordinator_mbit=ns.coordinator_mbit,
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
        f"{params / 1e6:.1f}M parameters, {ns.islands} islands, {ns.step_seconds:g} s a step; each island's link "
        f"{ns.bandwidth_mbit:g} Mbit/s, {ns.rtt_ms:g} ms{f', loss {ns.loss:g}' if ns.loss else ''}"
        f"{'' if link.tls else ', no TLS'}; {got[0].streams} TCP stream(s) a transfer"
    )
    print(
        f"{'codec':>8} {'down':>8} {'H':>5} {'τ':>4} {'P':>2} {'up MB':>8} {'down MB':>8} {'sync s':>7} "
        f"{'(coord)':>7} {'util':>6}"
    )
    for i, e in enumerate(got[:20]):
        print(
            f"{e.codec:>8} {e.downlink_codec:>8} {e.sync_every:>5} {e.overlap_steps:>4} {e.fragments:>2} "
            f"{e.bytes_up_per_round / 1e6:>8.1f} {e.bytes_down_per_round / 1e6:>8.1f} {e.sync_seconds:>7.2f} "
            f"{e.coordinator_seconds:>7.2f} {e.utilisation:>6.1%}{'  <- recommended' if i == 0 else ''}"
        )
    best = got[0]
    flags = f"--codec {best.codec} --downlink-codec {best.downlink_codec} --sync-every {best.sync_every}"
    flags += f" --fragments {best.fragments}" if best.fragments > 1 else ""
    island = f" --overlap-steps {best.overlap_steps}" if best.overlap_steps else ""
    island += " --streaming" if best.fragments > 1 else ""
    reached = "reaches" if best.utilisation >= ns.target else "is the best; nothing reaches"
    print(
        f"\nrecommended ({reached} {ns.target:.0%}): atoll coordinator {flags}; atoll island{island or ' (defaults)'}"
    )
    return 0
