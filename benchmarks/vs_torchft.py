"""atoll's DiLoCo against torchft's, side by side on one workload, with the floors measured in the same run.

    pip install -e '.[bench]'          # torchft, the peer: a benchmark extra, never a runtime dependency
    python benchmarks/vs_torchft.py [--model tiny|gpt-125m] [--pairs 3] [--rounds 4] [--sync-every 2]
                                    [--codecs identity int8] [--noise fresh|reused] [--peer DIR ...]

A second torchft (the newest on the package index, whose module is also ``torchft``) goes into a folder
of its own and is named with ``--peer``; each pair then runs atoll and every torchft, in turn:

    pip install --no-deps --target .peers/torchft-nightly torchft-nightly  # (the bench extra brings its needs)
    python benchmarks/vs_torchft.py --model gpt-125m --peer .peers/torchft-nightly

The workload (issue 21): 2 workers, the preset's tensors, inner steps that set every gradient to seeded
noise and take an SGD step (both systems do identical, cheap compute), H = ``--sync-every``, outer
Nesterov lr 0.7 / momentum 0.9. ``--noise reused`` draws the noise into one buffer per parameter
for the whole run (the same values): drawn afresh (the default, the issue's workload), the workload
faults in 2|θ| of new pages every step, whose system time on this VM was ~0.1 s in most steps and
0.8-1.4 s in some, which then shows as the workers entering the sync far apart; torchft's workers
made fewer of those faults (their allocator reused what their sync freed).

- torchft 0.2.0: a lighthouse, one Manager and one reconfigurable gloo process group per worker (a
  replica group of one rank), ``torchft.local_sgd.DiLoCo`` (pseudo-gradient all-reduce, the outer
  step in every replica). A worker's sync time is its ``inner_optimizer.step()`` at the H-th step,
  which runs the quorum, the all-reduce and the outer step.
- atoll: ``atoll coordinator`` and two ``DiLoCo(model, CoordinatorLink(...))`` workers; the sync time
  is ``sync.step()`` at the H-th step (push, the outer step on the coordinator, pull, apply). Codec
  ``identity``, or ``int8`` both ways (downlink with coordinator-side error feedback).

Every process of both systems runs one torch thread (``torch.set_num_threads(1)`` in the workers,
``--threads 1`` for the coordinator): three processes share the 2 cores of the dev machine, and
more threads than cores stall each parallel op on a descheduled thread. The coordinator's outer step
and decodes still run on both cores, on its tensor workers (``--tensor-workers``, by default one per
core its one torch thread leaves idle), each going at its own pace. ``--coordinator-threads 2``
gives the coordinator's torch kernels both cores instead: during a sync the islands wait on it, where
torchft's two workers each work on one.

Each system runs in its own network namespace (``unshare -rn``, when available), so the loopback
counter counts only that run: over the whole run per round (θ_0's transfers included), and in the
steady rounds (between the first and the last round's end, as worker 0 sees them: the other
worker's transfers at either end can fall on either side, which moves the figure by up to ~0.25|θ|
over 3 steady rounds). For atoll also the payload bytes by the coordinator's own counters (pushes
accepted, which leave out θ_0's upload, plus pulls served), per round after θ_0's one pull (|θ|):
no boundaries, so a byte sent twice shows there exactly; and the loopback bytes over all the
payload bytes, θ_0's upload included (framing, TCP); and the payload bytes the coordinator counted
as sent again, by cause (``atoll_resent_bytes_total``: a push cut, an eager push's data read into
nothing, a duplicate, a pull answered again). Runs are
interleaved by pairs, the order alternating. Printed per pair:
the median steady sync time (rounds after the first) of each system and their ratio, how far apart
the two workers entered the sync (the earlier one waits for the other: that counts in its time), the CPU
seconds a sync took (each worker's own during its sync, plus the service process's, the coordinator
or the lighthouse, from the first worker's entry to the last one's exit, sampled every 20 ms; and
all of it over 2 cores x that window: how busy the sync kept the machine), bytes on
loopback per round (and over |θ|), each worker's peak RSS (and the coordinator's), and the largest
difference between the two systems' final θ. The floors, measured in the same run: |θ| over one raw
loopback TCP stream, and a 2-process gloo all-reduce of |θ| fp32.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)

VOCAB = {"tiny": 65, "gpt-125m": 50257}
"""The bundled text's character vocabulary for the tiny model; GPT-2's for the 124M preset."""


# ---- what both systems train ---------------------------------------------------------------------------
def build(model: str):
    import torch

    from atoll.models import TinyGPT, preset

    torch.manual_seed(0)
    return TinyGPT(preset(model, vocab_size=VOCAB[model]))


def noise_grads(model, gen, buffers: dict | None) -> None:
    """Every gradient set to seeded noise (1e-3): drawn afresh each step (``buffers`` None: the
    issue's workload), or into one buffer per parameter kept for the whole run (the same values,
    without the workload faulting in 2|θ| of new pages every step)."""
    import torch

    for p in model.parameters():
        if buffers is None:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
            continue
        buf = buffers.get(p)
        if buf is None:
            buf = buffers[p] = torch.empty(p.shape)
        torch.randn(p.shape, generator=gen, out=buf)
        p.grad = buf.mul_(1e-3)


def peak_rss(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds of a process, all its threads, so far (10 ms resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def theta_summary(model, name: str) -> list[list[float]]:
    """Per parameter, in float64: the sum of its total update θ − θ_0, and of its absolute values (enough
    to tell apart two runs' final θ, which differ from θ_0 by a few 1e-4)."""
    import torch

    with torch.no_grad():
        init = dict(build(name).named_parameters())
        out = []
        for n, p in model.named_parameters():
            d = p.detach().double() - init[n].detach().double()
            out.append([float(d.sum()), float(d.abs().sum())])
        return out


def lo_bytes() -> int:
    """Bytes the loopback interface received (= sent) in this network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- workers (one process each) -------------------------------------------------------------------------
def torchft_worker(a) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    model = build(a.model)
    inner = torch.optim.SGD(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=300)),
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        min_replica_size=2,
        use_async_quorum=False,
        replica_id=f"w{a.index}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=a.lighthouse,
        port=0,
        timeout=timedelta(seconds=300),
        quorum_timeout=timedelta(seconds=300),
        connect_timeout=timedelta(seconds=60),
    )
    gen = torch.Generator().manual_seed(1000 + a.index)
    syncs, marks, spans, noise = [], [], [], ({} if a.noise == "reused" else None)
    with DiLoCo(manager, [model], inner, outer, sync_every=a.sync_every, backup_device=torch.device("cpu")):
        for step in range(1, a.rounds * a.sync_every + 1):
            noise_grads(model, gen, noise)
            started, wall, cpu0 = time.perf_counter(), time.time(), cpu_seconds()
            inner.step()  # at the H-th step: quorum, all-reduce of the pseudo-gradients, outer step
            if step % a.sync_every == 0:
                syncs.append(time.perf_counter() - started)
                spans.append([wall, time.time(), cpu0, cpu_seconds()])
                marks.append(lo_bytes())
    manager.shutdown(wait=False)
    print(
        json.dumps(
            {"syncs": syncs, "marks": marks, "spans": spans, "rss": peak_rss(), "theta": theta_summary(model, a.model)}
        )
    )


def atoll_worker(a) -> None:
    import torch

    from atoll.islands import CoordinatorLink, DiLoCo

    torch.set_num_threads(1)
    model = build(a.model)
    inner = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1000 + a.index)
    syncs, marks, spans, noise = [], [], [], ({} if a.noise == "reused" else None)
    link = CoordinatorLink(a.coordinator, run_id="vs", island_id=f"w{a.index}")
    with DiLoCo(model, link) as sync:
        for _ in range(a.rounds * a.sync_every):
            noise_grads(model, gen, noise)
            inner.step()
            started, wall, cpu0 = time.perf_counter(), time.time(), cpu_seconds()
            if sync.step(tokens=1) is not None:  # push, outer step, pull, apply
                syncs.append(time.perf_counter() - started)
                spans.append([wall, time.time(), cpu0, cpu_seconds()])
                marks.append(lo_bytes())
    print(
        json.dumps(
            {"syncs": syncs, "marks": marks, "spans": spans, "rss": peak_rss(), "theta": theta_summary(model, a.model)}
        )
    )


# ---- one system's run (inside its own network namespace) ------------------------------------------------
def run_system(a) -> None:
    if a.netns:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    before = lo_bytes()
    me = [sys.executable, str(Path(__file__).resolve())]
    run_args = ["--model", a.model, "--rounds", str(a.rounds), "--sync-every", str(a.sync_every), "--noise", a.noise]
    coord = lighthouse = None
    with tempfile.TemporaryDirectory(prefix="vs-") as tmp:
        if a.system == "torchft":
            from torchft._torchft import LighthouseServer

            lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
            target = ["--lighthouse", lighthouse.address()]
        else:
            port_file = Path(tmp) / "port"
            codec = ["--codec", a.codec, "--downlink-codec", a.codec]
            state, env = str(Path(tmp) / "state"), None
            if a.state_store:  # the state in an object store (issue 36): a SeaweedFS server in this namespace
                from atoll.harness.seaweed import SeaweedS3

                store = SeaweedS3(Path(tmp) / "seaweed").start()  # (dies with this process, whatever happens)
                store.make_bucket("atoll-vs")
                state, env = "s3://atoll-vs/run", {**os.environ, **store.env()}
                state_args = ["--work-dir", str(Path(tmp) / "work")]
            coord = subprocess.Popen(
                [sys.executable, "-m", "atoll", "coordinator", "--host", "127.0.0.1", "--port", "0",
                 "--state-dir", state, *(state_args if a.state_store else []),
                 "--port-file", str(port_file), "--run-id", "vs",
                 "--admin-port", "0", "--admin-port-file", str(Path(tmp) / "admin"),
                 "--sync-every", str(a.sync_every), "--outer-lr", "0.7", "--outer-momentum", "0.9",
                 "--quorum", "2", "--lease-seconds", "120", *codec, "--threads", str(a.coordinator_threads),
                 "--log-level", "WARNING"],
                stdout=subprocess.DEVNULL,
                env=env,
            )  # fmt: skip
            while not (port_file.exists() and (Path(tmp) / "admin").exists()):
                if coord.poll() is not None:
                    raise RuntimeError(f"the coordinator exited with {coord.returncode}")
                time.sleep(0.05)
            target = ["--coordinator", f"127.0.0.1:{port_file.read_text().strip()}"]
        workers = [
            subprocess.Popen(
                [*me, "--role", f"{a.system}-worker", "--index", str(i), *run_args, *target],
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        coord_rss, service_cpu = [0], []
        service = coord.pid if coord is not None else os.getpid()  # torchft's lighthouse runs in this process

        def watch() -> None:
            """The coordinator's peak RSS, and the CPU time of the service process (the coordinator, or
            the lighthouse) every 20 ms, to tell how much CPU each sync took on every side."""
            while (coord is None or coord.poll() is None) and any(w.poll() is None for w in workers):
                if coord is not None:
                    coord_rss[0] = max(coord_rss[0], peak_rss(coord.pid))
                service_cpu.append([time.time(), cpu_seconds(service)])
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        outs = [json.loads(w.communicate()[0].strip().splitlines()[-1]) for w in workers]
        watcher.join()
        after = lo_bytes()
        payload, resent = None, {}
        if coord is not None:
            coord_rss[0] = max(coord_rss[0], peak_rss(coord.pid))
            admin = f"http://127.0.0.1:{(Path(tmp) / 'admin').read_text().strip()}/api/status"
            with urllib.request.urlopen(admin, timeout=30) as resp:  # after the last loopback reading
                counters = json.load(resp)["counters"]
            payload = counters["bytes_in"] + counters["bytes_out"]
            resent = counters.get("resent_bytes", {})
            coord.terminate()
            coord.wait(30)
            if a.state_store:
                store.stop()
        if lighthouse is not None:
            lighthouse.shutdown()
    print(
        json.dumps(
            {
                "workers": outs,
                "lo_bytes": after - before,
                "coordinator_rss": coord_rss[0],
                "payload": payload,
                "resent": resent,
                "service_cpu": service_cpu,
                "peer": torchft_version() if a.system == "torchft" else "",
            }
        ),
        flush=True,
    )


def torchft_version() -> str:
    """The torchft this process imports, as its distribution names it (torchft 0.2.0, torchft-nightly ...)."""
    import importlib.metadata

    dists = importlib.metadata.packages_distributions().get("torchft", ["torchft"])
    import torchft

    where = Path(torchft.__file__).resolve().parent.parent
    for dist in dists:  # the one installed where the imported module lives
        found = importlib.metadata.distribution(dist)
        if Path(found.locate_file("")).resolve() == where:
            return f"{dist} {found.version}"
    return f"{dists[0]} {importlib.metadata.version(dists[0])}"


# ---- the floors -------------------------------------------------------------------------------------------
def floors(a) -> None:
    """|θ| over one raw loopback TCP stream, and a 2-process gloo all-reduce of |θ| fp32."""
    if a.netns:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    import torch

    n = sum(p.numel() for p in build(a.model).parameters())
    nbytes = 4 * n
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def receive() -> None:
        conn, _ = srv.accept()
        left, buf = nbytes, bytearray(1 << 22)
        while left:
            left -= conn.recv_into(buf, min(len(buf), left))
        conn.sendall(b"k")
        conn.close()

    t = threading.Thread(target=receive)
    t.start()
    payload = memoryview(bytearray(nbytes))
    with socket.create_connection(("127.0.0.1", port)) as c:
        started = time.perf_counter()
        c.sendall(payload)
        c.recv(1)
        tcp = time.perf_counter() - started
    t.join()
    del payload
    port = free_port()
    me = [sys.executable, str(Path(__file__).resolve()), "--model", a.model]
    procs = [
        subprocess.Popen([*me, "--role", "gloo-rank", "--index", str(r), "--port", str(port)], stdout=subprocess.PIPE)
        for r in range(2)
    ]
    gloo = max(float(p.communicate()[0]) for p in procs)
    print(json.dumps({"numel": n, "tcp_seconds": tcp, "gloo_seconds": gloo}), flush=True)
    del torch


def gloo_rank(a) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.index, world_size=2)
    t = torch.ones(sum(p.numel() for p in build(a.model).parameters()))
    dist.all_reduce(t)  # warm-up
    dist.barrier()
    started = time.perf_counter()
    dist.all_reduce(t)
    print(time.perf_counter() - started)
    dist.destroy_process_group()


# ---- the driver -------------------------------------------------------------------------------------------
def isolated(args: list[str], path: str = "") -> dict:
    """Run this script with ``args`` in a fresh network namespace when unshare works (else plainly);
    ``path``: a folder ahead of the installed packages (a peer installed with ``pip --target``)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    netns = shutil.which("unshare") is not None and shutil.which("ip") is not None
    if netns:
        probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True)
        netns = probe.returncode == 0
    if netns:
        cmd = ["unshare", "-rn", *cmd, "--netns"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(path).resolve()), env.get("PYTHONPATH")) if p)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["netns"] = netns
    return got


def steady_bytes(run: dict) -> float:
    """Loopback bytes per round between the first and the last round's end (worker 0's marks): the
    steady rounds, without θ_0's transfers at the start."""
    marks = run["workers"][0]["marks"]
    return (marks[-1] - marks[0]) / max(len(marks) - 1, 1)


def after_first(values: list) -> float:
    """The median over the rounds after the first (the first, when it is the only one)."""
    return statistics.median(values[1:] if len(values) > 1 else values)


def steady(run: dict) -> float:
    """The median over rounds after the first of the slower worker's sync time."""
    return after_first([max(times) for times in zip(*(w["syncs"] for w in run["workers"]), strict=True)])


def start_gap(run: dict) -> float:
    """The median over rounds after the first of how far apart the two workers entered the sync (a gap
    counts in the earlier worker's sync time: it waits for the other's pseudo-gradient)."""
    return after_first([abs(a[0] - b[0]) for a, b in zip(*(w["spans"] for w in run["workers"]), strict=True)])


def sync_cpu(run: dict) -> tuple[float, float, float]:
    """The median over rounds after the first of the CPU seconds one sync took: (the workers' own,
    within each one's sync; the service process's, from the first worker's entry to the last one's
    exit; both over 2 cores x that window, the share of the machine the sync kept busy)."""
    samples = run["service_cpu"]
    times = [s[0] for s in samples]

    def service_at(when: float) -> float:  # the service's CPU at a wall time, linearly interpolated
        i = min(max(bisect.bisect_left(times, when), 1), len(samples) - 1)
        (t0, c0), (t1, c1) = samples[i - 1], samples[i]
        return c0 + (c1 - c0) * min(max((when - t0) / max(t1 - t0, 1e-9), 0.0), 1.0)

    rows = []
    for spans in list(zip(*(w["spans"] for w in run["workers"]), strict=True))[1:]:
        start, end = min(s[0] for s in spans), max(s[1] for s in spans)
        own = sum(s[3] - s[2] for s in spans)
        service = service_at(end) - service_at(start)
        rows.append((own, service, (own + service) / (2 * (end - start))))
    if not rows or len(samples) < 2:
        return float("nan"), float("nan"), float("nan")
    return tuple(statistics.median(r[k] for r in rows) for k in range(3))


def cpu(run: dict) -> str:
    own, service, busy = sync_cpu(run)
    return f"{own:.2f} s workers + {service:.2f} s service = {busy:.0%} of 2 cores"


def rss(run: dict, theta: int) -> str:
    """Each worker's peak RSS in MiB and over |θ|."""
    return ", ".join(f"{w['rss'] / 2**20:.0f} MiB ({w['rss'] / theta:.1f}|θ|)" for w in run["workers"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(VOCAB))
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--sync-every", type=int, default=2)
    p.add_argument("--codecs", nargs="+", default=["identity"], help="atoll's codec(s), each in its own pairs")
    p.add_argument(
        "--noise",
        default="fresh",
        choices=["fresh", "reused"],
        help="the noise gradients drawn into new tensors every step (the issue's workload) or into buffers "
        "kept for the run (no page faults of the workload's own)",
    )
    p.add_argument(
        "--state-store",
        action="store_true",
        help="atoll's coordinator keeps its state in an S3-compatible store (a local SeaweedFS server) "
        "rather than on the disk: a round is published once its record's PUT completed",
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="DIR",
        help="a torchft installed in its own folder (pip install --target DIR): measured in the same pairs, "
        "after the one installed with the bench extra (repeat for more)",
    )
    p.add_argument(
        "--coordinator-threads",
        type=int,
        default=1,
        help="torch threads of atoll's coordinator (1, like every worker of both systems: three processes on "
        "the dev machine's 2 cores; 2: the coordinator takes both while the islands wait on their sync, "
        "as torchft's two workers take one each)",
    )
    p.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    p.add_argument("--system", default="", help=argparse.SUPPRESS)
    p.add_argument("--codec", default="identity", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--netns", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    roles = {
        "torchft-worker": torchft_worker,
        "atoll-worker": atoll_worker,
        "run": run_system,
        "floors": floors,
        "gloo-rank": gloo_rank,
    }
    if a.role != "driver":
        roles[a.role](a)
        return
    try:
        import torchft  # noqa: F401
    except ImportError:
        sys.exit("torchft is not installed: pip install -e '.[bench]'")
    for folder in a.peer:
        if not (Path(folder) / "torchft" / "__init__.py").is_file():
            p.error(f"--peer {folder}: no torchft in it (pip install --target {folder} torchft-nightly ...)")
    run_args = ["--model", a.model, "--rounds", str(a.rounds), "--sync-every", str(a.sync_every), "--noise", a.noise,
                "--coordinator-threads", str(a.coordinator_threads)]  # fmt: skip
    floor = isolated(["--role", "floors", "--model", a.model])
    theta = 4 * floor["numel"]
    print(
        f"model {a.model}: {floor['numel']:,} parameters, |θ| = {theta / 2**20:.1f} MiB; H={a.sync_every}, "
        f"{a.rounds} rounds, 2 workers; network namespaces: {floor['netns']}"
    )
    print(
        f"floors: one TCP stream moves |θ| in {floor['tcp_seconds'] * 1e3:.1f} ms, "
        f"a 2-process gloo all-reduce of |θ| takes {floor['gloo_seconds'] * 1e3:.1f} ms"
    )
    peers = ["", *a.peer]  # "": the torchft installed with the bench extra
    for codec in a.codecs:
        ratios: dict[str, list[float]] = {}
        for pair in range(a.pairs):
            order = ["atoll", *peers]
            order = order[pair % len(order) :] + order[: pair % len(order)]  # each system leads in turn
            store = ["--state-store"] if a.state_store else []
            runs = {}
            for s in order:
                system = "atoll" if s == "atoll" else "torchft"
                runs[s] = isolated(["--role", "run", "--system", system, "--codec", codec, *run_args, *store], s)
            at = runs["atoll"]
            for peer in peers:
                tf = runs[peer]
                ratios.setdefault(tf["peer"], []).append(steady(at) / steady(tf))
                print(f"[{codec}] pair {pair + 1} ({' then '.join(Path(o).name or 'torchft' for o in order)}): "
                      + describe(at, tf, floor, theta, a.rounds), flush=True)  # fmt: skip
        for name, got in ratios.items():
            print(
                f"[{codec}] median sync ratio atoll / {name} over {a.pairs} pairs: {statistics.median(got):.2f}x "
                f"({', '.join(f'{r:.2f}' for r in got)})"
            )


def resent_causes(resent: dict, theta: int) -> str:
    """The coordinator's bytes sent again, by cause, over |θ| (``none`` when there were none)."""
    return ", ".join(f"{cause} {n / theta:.3f}|θ|" for cause, n in resent.items() if n) or "none"


def describe(at: dict, tf: dict, floor: dict, theta: int, rounds: int) -> str:
    """One pair's line: atoll's run against one torchft's."""
    peer = tf["peer"]
    pairs = list(zip(at["workers"][0]["theta"], tf["workers"][0]["theta"], strict=True))
    drift = sum(abs(x[0] - y[0]) for x, y in pairs) / max(sum(y[1] for _, y in pairs), 1e-30)
    return (
        f"sync atoll {steady(at):.3f} s, {peer} {steady(tf):.3f} s, ratio {steady(at) / steady(tf):.2f}x "
        f"(floors: {steady(at) / floor['tcp_seconds']:.0f}x TCP, "
        f"{peer} {steady(tf) / floor['gloo_seconds']:.0f}x gloo; the workers entered it {start_gap(at):.3f} "
        f"and {start_gap(tf):.3f} s apart; CPU in a sync: atoll {cpu(at)}, {peer} {cpu(tf)}); "
        "loopback bytes/round atoll "
        f"{at['lo_bytes'] / rounds / theta:.2f}|θ|, {peer} {tf['lo_bytes'] / rounds / theta:.2f}|θ| "
        f"({at['lo_bytes'] / max(tf['lo_bytes'], 1):.2f}x), steady rounds atoll "
        f"{steady_bytes(at) / theta:.2f}|θ|, {peer} {steady_bytes(tf) / theta:.2f}|θ|; atoll's payload "
        f"bytes (coordinator's counters) {(at['payload'] - theta) / rounds / theta:.3f}|θ| a round "
        f"after θ_0, loopback {at['lo_bytes'] / (at['payload'] + theta):.4f}x them with θ_0's upload, sent again "
        f"{sum(at['resent'].values()) / theta:.3f}|θ| ({resent_causes(at['resent'], theta)}); "
        "peak RSS: atoll workers "
        f"{rss(at, theta)}, coordinator "
        f"{at['coordinator_rss'] / 2**20:.0f} MiB ({at['coordinator_rss'] / theta:.1f}|θ|), {peer} workers "
        f"{rss(tf, theta)}; the two final updates θ − θ_0 differ by {drift:.1e} of {peer}'s"
    )


if __name__ == "__main__":
    main()
