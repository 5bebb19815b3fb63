"""Islands resume exactly: from their DiLoCo state or checkpoint, across a coordinator restart, and
refuse a state that is not theirs."""

from __future__ import annotations

import copy
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from support import H, ServerThread, batches, config, inner_step, island, make_diloco, make_model, wait_for

from atoll.coordinator.options import NetworkOptions
from atoll.islands import DiLoCo
from atoll.objects import ObjectStore


def theta(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- an island resumes exactly ------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [0, 2])
def test_a_push_waits_for_the_checkpoint_that_before_push_started(start_server, overlap):
    """A push the coordinator counts must have a durable checkpoint behind it: resumed from an older
    one, an island would replay that round's data on a later θ. (Before: the push went out while the
    checkpoint was still being written; under load `benchmarks/resume.py` then ended 1 run in 3 with
    another θ.)"""
    srv = start_server(config())
    written, waiting = threading.Event(), threading.Event()

    def before_push(sync):
        def wait_for_the_write():
            waiting.set()
            assert written.wait(20)

        return wait_for_the_write

    model, opt, sync = island(srv.address, before_push=before_push, overlap_steps=overlap)
    sync.start()
    done = threading.Thread(target=lambda: [sync.step(tokens=8, loss=1.0) for _ in range(H + overlap)])
    done.start()
    try:
        assert waiting.wait(20)
        time.sleep(0.5)  # a window for the push that must not come yet (an absence has no event to wait on)
        assert srv.inspect(lambda s: (s.round, s.accumulator.committed_islands())) == (0, [])
        written.set()
        done.join(20)
        assert srv.inspect(lambda s: s.round) == 1 and sync.history[0].round == 0
    finally:
        written.set()
        done.join(20)
        sync.close()


@pytest.mark.parametrize("codec", ["identity", "int8"])
def test_an_island_restarted_from_its_state_ends_bitwise_where_it_would_have(start_server, tmp_path, codec):
    """The island checkpoints at each push (``before_push``), dies two steps into round 2, and a new
    process restarts from the checkpoint: it re-pushes round 1 (the coordinator has it), does not
    redo it, and after 5 rounds the island and the coordinator hold bitwise the θ of a run that was
    never interrupted. AdamW moments, the data position and the error-feedback residuals included."""
    steps = 5 * H
    data = batches(steps)
    ef = dict(error_feedback=True, error_feedback_decay=0.5) if codec != "identity" else {}

    ref = start_server(config(codec=codec, **ef), tmp_path / "ref")
    model, opt, sync = island(ref.address)
    sync.start()
    for b in data:
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    sync.close()
    want, want_coord = theta(model), ref.inspect(lambda s: {k: v.clone() for k, v in s.model.params.items()})

    srv = start_server(config(codec=codec, **ef), tmp_path / "run")
    saved = {}

    def checkpoint(s: DiLoCo) -> None:  # what atoll island --checkpoint-dir saves at each push
        saved.update(step=s.inner_steps, model=copy.deepcopy(model.state_dict()), opt=copy.deepcopy(opt.state_dict()))
        saved["diloco"] = copy.deepcopy(s.state_dict())

    model, opt, sync = island(srv.address, before_push=checkpoint)
    sync.start()
    for b in data[: 2 * H + 2]:  # dies two steps into round 2, its push of round 1 in
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    assert saved["step"] == 2 * H and saved["diloco"]["flights"][0]["round"] == 1
    sync.close(leave=False)  # the process is gone; its lease is still live

    model, opt, sync = island(srv.address)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sync.load_state_dict(saved["diloco"])
    sync.start()  # same session: welcome back; round 1 re-pushed: a duplicate
    assert sync.round == 2 and srv.inspect(lambda s: s.history[1]["islands"]) == ["solo"]
    for b in data[saved["step"] :]:
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    sync.close()
    got = theta(model)
    for n in want:
        assert torch.equal(got[n], want[n]), n
    coord = srv.inspect(lambda s: {k: v.clone() for k, v in s.model.params.items()})
    assert all(torch.equal(coord[k], want_coord[k]) for k in want_coord)
    assert srv.inspect(lambda s: s.round) == 5


def run_through(srv: ServerThread, data: list, overlap: int) -> tuple[dict, dict]:
    """θ of an overlapping island that trains on ``data`` uninterrupted, and the coordinator's."""
    model, opt, sync = island(srv.address, overlap_steps=overlap)
    sync.start()
    for b in data:
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    sync.drain()
    sync.close()
    return theta(model), srv.inspect(lambda s: {k: v.clone() for k, v in s.model.params.items()})


def restart_and_finish(srv: ServerThread, saved: dict, data: list, overlap: int, want: tuple[dict, dict]) -> None:
    """A new island process restarted from ``saved`` trains on to the end of ``data``: it and the
    coordinator then hold bitwise ``want`` (the island's θ, the coordinator's)."""
    model, opt, sync = island(srv.address, overlap_steps=overlap)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sync.load_state_dict(saved["diloco"])
    sync.start()
    for b in data[saved["step"] :]:
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    sync.drain()
    sync.close()
    want_theta, want_coord = want
    coord = srv.inspect(lambda s: {k: v.clone() for k, v in s.model.params.items()})
    assert all(torch.equal(coord[k], want_coord[k]) for k in want_coord)
    got = theta(model)
    for n in want_theta:
        assert torch.equal(got[n], want_theta[n]), n


@pytest.mark.parametrize("dies_after", [1, 2, 3])
def test_an_overlapping_island_restarted_with_its_exchange_in_flight_ends_bitwise(start_server, tmp_path, dies_after):
    """An island overlapping its exchange with 2 inner steps checkpoints at its push of round 1 and dies
    ``dies_after`` steps later: before the update was merged into its parameters, as it was, or after.
    Restarted from the checkpoint, it re-pushes the flight (the coordinator has it), takes the same
    two overlapped steps again and merges the same update: after 5 rounds the island and the
    coordinator hold bitwise the θ of a run that was never interrupted."""
    overlap, steps = 2, 5 * H
    data = batches(steps)
    want = run_through(start_server(config(), tmp_path / "ref"), data, overlap)

    srv = start_server(config(), tmp_path / "run")
    saved = {}

    def checkpoint(s: DiLoCo) -> None:
        saved.update(step=s.inner_steps, model=copy.deepcopy(model.state_dict()), opt=copy.deepcopy(opt.state_dict()))
        saved["diloco"] = copy.deepcopy(s.state_dict())

    model, opt, sync = island(srv.address, before_push=checkpoint, overlap_steps=overlap)
    sync.start()
    for b in data[: 2 * H + dies_after]:
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    assert saved["step"] == 2 * H and saved["diloco"]["flights"][0]["round"] == 1
    sync.close(leave=False)  # the process is gone (its exchange, if still in flight, abandoned)
    restart_and_finish(srv, saved, data, overlap, want)


def test_an_island_checkpointed_with_its_merge_made_ready_in_the_background_ends_bitwise(start_server, tmp_path):
    """Overlapping, the exchange's thread checks the update once it is in, applies it to θ_start and
    makes the merge's delta (θ_start − snapshot) in the snapshot's storage, before the merge step. A
    checkpoint taken then holds the new θ_start and the delta, and says so: the island, killed and
    restarted from it, merges at its merge step with no exchange again, and after 5 rounds it and the
    coordinator hold bitwise the θ of a run that was never interrupted."""
    overlap, steps = 3, 5 * H
    data = batches(steps)
    want = run_through(start_server(config(codec="int8", error_feedback=True), tmp_path / "ref"), data, overlap)

    srv = start_server(config(codec="int8", error_feedback=True), tmp_path / "run")
    model, opt, sync = island(srv.address, overlap_steps=overlap)
    sync.start()
    for b in data[: 2 * H + 1]:  # round 1 pushed at 2H; its merge comes at 2H + 3
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    (flight,) = sync._exchanges.in_flight()
    wait_for(lambda: flight.merge_ready)
    saved = dict(step=sync.inner_steps, model=copy.deepcopy(model.state_dict()), opt=copy.deepcopy(opt.state_dict()))
    saved["diloco"] = copy.deepcopy(sync.state_dict())
    (kept,) = saved["diloco"]["flights"]
    assert kept["merge_ready"] and kept["round"] == 1
    assert saved["diloco"]["merge_deltas"] and not saved["diloco"]["snapshots"]
    sync.close(leave=False)
    restart_and_finish(srv, saved, data, overlap, want)


def test_a_state_of_another_island_is_refused(start_server):
    srv = start_server(config())
    model, opt, sync = island(srv.address)
    sync.start()
    state = sync.state_dict()
    sync.close()
    _, _, other = island(srv.address, island_id="other")
    with pytest.raises(ValueError, match="island 'solo'"):
        other.load_state_dict(state)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig, inner", [("SIGKILL", "adamw"), ("SIGTERM", "adamw"), ("SIGKILL", "muon")])
def test_an_island_process_killed_or_preempted_resumes_from_its_checkpoint_bitwise(tmp_path, sig, inner):
    """``atoll island --checkpoint-dir``, SIGKILLed (or SIGTERMed: preempted) a few steps into round 2
    and restarted with the same command: the run ends with bitwise the θ (and the per-round losses)
    of the run that was never interrupted (model and AdamW state via torch.distributed.checkpoint, data
    position, RNG, DiLoCo state; with ``--inner-optimizer muon``, Muon's momentum and AdamW's moments of
    the rest, and both schedules). On SIGTERM the island checkpoints where it stands, leaves and exits
    143 within seconds (a Kubernetes or Slurm grace period is 30 s by default).
    benchmarks/resume.py measures heal time and checkpoint cost on the same code."""
    import argparse
    import signal

    from benchmarks.resume import run

    args = argparse.Namespace(
        rounds=4, sync_every=10, kill_after_round=1, kill_delay=0.2, island_flags=f"--inner-optimizer {inner}"
    )
    ref = run(tmp_path / "ref", args, kill=False)
    got = run(tmp_path / "killed", args, kill=True, sig=getattr(signal, sig))
    assert got["round"] == ref["round"] == 4
    assert got["digest"] == ref["digest"]
    assert [h["loss"] for h in got["history"]] == [h["loss"] for h in ref["history"]]
    assert got["heal_seconds"] < 60
    if sig == "SIGTERM":
        assert got["killed_exit"] == 143 and got["exit_seconds"] < 15.0, got


def test_the_same_process_rejoins_a_restarted_coordinator(tmp_path):
    """A coordinator restart forgets nobody's session: the island's next call re-joins it."""
    srv = ServerThread(config(), tmp_path / "state").start()
    port = srv.server.port
    model, opt, sync = island(srv.address, heartbeat_seconds=0.2)
    try:
        sync.start()
        for b in batches(H):
            sync.step(tokens=32, loss=inner_step(model, opt, b))
        srv.stop()
        srv = ServerThread(config(), tmp_path / "state", network=NetworkOptions(port=port)).start()
        for b in batches(H):
            sync.step(tokens=32, loss=inner_step(model, opt, b))
        assert srv.inspect(lambda s: s.round) == 2
    finally:
        sync.close()
        srv.stop()


# ---- SIGTERM: Slurm preemption, Kubernetes pod deletion ---------------------------------------------
def test_sigterm_stops_at_the_end_of_the_step_and_the_with_block_leaves_the_run(start_server):
    """(Before: only Ctrl-C left; a preempted island held its round for a whole lease.)"""
    import os
    import signal

    from atoll.islands.errors import Preempted

    srv = start_server(config())
    model, opt, sync = island(srv.address, island_id="pre")
    data = batches(H + 2)
    with pytest.raises(Preempted) as info, sync:
        for i, b in enumerate(data):
            if i == H + 1:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler only flags: this step completes
            sync.step(tokens=32, loss=inner_step(model, opt, b))
    assert info.value.code == 143 and sync.inner_steps == H + 2 and [h.round for h in sync.history] == [0]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back by close()
    assert srv.inspect(lambda s: s.states()) == {"pre": "left"}


def test_sigterm_while_waiting_for_the_outer_step_keeps_the_exchange_for_a_checkpoint(start_server, raw_island):
    import os
    import signal

    from atoll.islands.errors import Preempted

    srv = start_server(config(quorum=2))
    model, opt, sync = island(srv.address, island_id="pre", pull_wait_seconds=0.5)
    sync.start()
    other = raw_island(srv.address, "other", {n: tuple(p.shape) for n, p in model.named_parameters()})
    other.join()  # live, never pushes: the round waits for it

    def preempt_once_it_waits():
        wait_for(lambda: srv.inspect(lambda s: "pre" in s.accumulator.committed and s.pulls.polling), what="a wait")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=preempt_once_it_waits, daemon=True).start()
    try:
        with pytest.raises(Preempted):  # (the round never closes: a step waiting for it would never end)
            for b in batches(H):
                sync.step(tokens=32, loss=inner_step(model, opt, b))
        sd = sync.state_dict()  # what the reference island checkpoints before leaving
        assert [f["round"] for f in sd["flights"]] == [0] and sd["routes"][0]["round"] == 0
    finally:
        sync.close()
    assert srv.inspect(lambda s: s.accumulator.committed_islands()) == ["pre"]  # its push counts


@pytest.mark.parametrize("where", ["local", "s3"])
def test_island_checkpoint_in_a_users_own_loop_resumes_bitwise(start_server, tmp_path, where, request):
    """The library's checkpoint helper in a loop of the user's: model, AdamW, DiLoCo state, RNG and the
    loop's data generator, saved at each push; a process that dies mid-round and a new one that loads
    it end where the uninterrupted run does, bitwise. In an object store (``s3://``, a real server)
    the new process runs on "another machine": another working dir, the first one deleted."""
    from atoll.islands import IslandCheckpoint

    url = request.getfixturevalue("s3_url") if where == "s3" else None
    machines = iter(range(100))

    def run(address, ckpt_dir, steps, crash_at=None):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(11)
        work = tmp_path / f"machine-{next(machines)}"
        if url is not None:
            ckpt_dir = f"{url}/{Path(ckpt_dir).name}"
        ckpt = IslandCheckpoint(
            ckpt_dir,
            model,
            opt,
            state=lambda: {"gen": gen.get_state()},
            load_state=lambda s: gen.set_state(s["gen"]),
            work_dir=work,
        )
        sync = make_diloco(model, address, island_id="solo", before_push=ckpt.save)
        resumed = ckpt.load(sync)
        sync.start()
        try:
            while sync.inner_steps < steps:
                if sync.inner_steps == crash_at:
                    sync.close(leave=False)  # as if killed: no Leave, the lease lapses
                    ckpt.wait()
                    if url is not None:
                        shutil.rmtree(work)  # and its machine is gone
                    return None, resumed
                x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
                sync.step(tokens=32, loss=inner_step(model, opt, (x, y)))
        finally:
            sync.close()
            ckpt.wait()
        return theta(model), resumed

    ref = start_server(config(), tmp_path / "ref")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (before: torch warned at every save that it assumed one process)
        want, _ = run(ref.address, tmp_path / "ck-ref", 3 * H)
    srv = start_server(config(), tmp_path / "run")
    assert run(srv.address, tmp_path / "ck", 3 * H, crash_at=H + 2) == (None, False)
    got, resumed = run(srv.address, tmp_path / "ck", 3 * H)
    assert resumed and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    if url is not None:  # what is in the store: the newest checkpoints, each complete
        listed = ObjectStore.from_url(f"{url}/ck").listing()
        steps = sorted({rel.split("/")[0] for rel in listed})
        assert 1 <= len(steps) <= 2 and all(f"{s}/done-0" in listed and f"{s}/.metadata" in listed for s in steps)


@pytest.mark.parametrize("mode", ["overlap", "decoupled"])
def test_an_island_restarted_into_a_finished_run_ends_holding_its_final_theta(start_server, tmp_path, mode):
    """Restarted from its checkpoint of its last push after the run completed, an island (overlapping,
    or in a decoupled run) re-pushed, took an inner step before the exchange was applied, and ended one
    step past the run's final θ. It now applies it at start() and takes no step: it holds θ bitwise."""
    srv = start_server(config(total_rounds=2, outer_mode="decoupled" if mode == "decoupled" else "sync"))
    options = {"overlap_steps": 2} if mode == "overlap" else {}
    saved = {}
    model, opt, sync = island(srv.address, before_push=lambda s: saved.update(state(model, opt, s)), **options)
    sync.start()
    data = batches(H)
    while not sync.run_complete:
        for b in data:
            sync.step(tokens=32, loss=inner_step(model, opt, b))
        sync.drain()  # the exchange in flight (overlapping, decoupled) applied before the next round
    sync.close()
    assert srv.inspect(lambda s: s.run_complete) and saved["diloco"]["flights"]
    final = srv.inspect(lambda s: {k: v.clone() for k, v in s.model.params.items()})

    model, opt, sync = island(srv.address, **options)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sync.load_state_dict(saved["diloco"])
    sync.start()
    try:
        assert sync.run_complete and sync.inner_steps == saved["step"]
        got = theta(model)
        assert all(torch.equal(got[n], final[n]) for n in final)
    finally:
        sync.close()


def state(model, opt, sync: DiLoCo) -> dict:
    """What atoll island --checkpoint-dir saves at each push."""
    return dict(
        step=sync.inner_steps,
        model=copy.deepcopy(model.state_dict()),
        opt=copy.deepcopy(opt.state_dict()),
        diloco=copy.deepcopy(sync.state_dict()),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,extra",
    [([], []), ([], ["--overlap-steps", "2"]), (["--outer-mode", "decoupled"], [])],
    ids=["sync", "overlap", "decoupled"],
)
def test_atoll_island_restarted_into_a_finished_run_holds_the_final_theta(group, tmp_path, mode, extra):
    """Hardening round 5, item 20 (left from round 3), from outside: ``atoll island --checkpoint-dir``
    started again with the same command after the run completed joins, holds the run's final θ bitwise
    (the digest of its model against the export's), takes no step and exits 0."""
    import subprocess
    import sys

    from safetensors.torch import load_file
    from support import collect_events, coordinator_flags, island_flags

    from atoll.workload.digest import param_digest

    state = tmp_path / "state"
    coord, address = group.start_coordinator(
        state, [*coordinator_flags(sync_every=5, quorum=1), "--total-rounds", "2", *mode]
    )
    flags = island_flags(address, "a", rounds=None, extra=["--checkpoint-dir", str(tmp_path / "ckpt"), *extra])
    first = group.start("a", flags)
    collect_events([first], until=lambda ev: any(e["event"] == "done" for e in ev), timeout=120)
    assert first.wait(60) == 0
    again = group.start("a-again", flags)
    after = collect_events([again], until=lambda ev: any(e["event"] == "done" for e in ev), timeout=120)
    assert again.wait(60) == 0
    coord.stop()
    out = tmp_path / "theta.safetensors"
    subprocess.run([sys.executable, "-m", "atoll", "export", "--state-dir", str(state), "--out", str(out)], check=True)
    joined = next(e for e in after if e["event"] == "joined")
    assert joined["run_complete"] and joined["digest"] == param_digest(load_file(str(out)))
    assert not [e for e in after if e["event"] == "round"]  # (no inner step, no exchange)
