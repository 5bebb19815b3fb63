"""The user's surface: no silent misreadings, fast clear failures, wrapped models, observability.

Each test is what a new user ran into: a flag read as another, an override dropped silently, a
wrong address hanging for minutes, a compiled model refused, buffers left unsynced, missing token
counts weighing 1, metrics without the loss, a traceback where one line would do.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
from support import exact_config, inner_step, make_diloco, wait_for

from atoll.coordinator import RunConfig
from atoll.islands import CoordinatorLink, CoordinatorRefused, DiLoCo
from atoll.islands import _legacy as diloco_module
from atoll.islands._transport import session as session_module
from atoll.islands._transport.client import RetryPolicy
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.reasons import Reason

H = 4


def model_fn(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def run_rounds(sync, model, rounds: int, seed: int = 1, tokens: int = 10) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(rounds * sync.sync_every):
        x = torch.randn(16, 6, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sync.step(tokens=tokens, loss=loss.item())


def diloco(address, model=None, **kw):
    kw.setdefault("island_id", "u")
    kw.setdefault("retry", RetryPolicy(give_up_seconds=15))
    return make_diloco(model if model is not None else model_fn(), address, run_id="t", **kw)


def test_the_import_paths_users_hold_keep_working_and_the_moved_ones_warn():
    import importlib
    import warnings

    import atoll.islands as islands
    from atoll.islands._transport import client as internal

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the public names warn about nothing
        for name in islands.__all__:
            assert getattr(islands, name) is not None, name
        from atoll.islands import CoordinatorLink, DiLoCo, IslandCheckpoint  # noqa: F401
    old = importlib.import_module("atoll.islands.client")
    for name in ("CoordinatorClient", "RetryPolicy"):
        with pytest.warns(DeprecationWarning, match=f"atoll.islands.client.{name} is deprecated: import it from"):
            assert getattr(old, name) is getattr(internal, name) is getattr(islands, name)
    with pytest.warns(DeprecationWarning, match="internal now"):
        assert old.PartialUpdate is internal.PartialUpdate
    assert all(not n.startswith("_") and getattr(islands, n).__module__.startswith("atoll.") for n in islands.__all__)


def test_diloco_s_typed_keyword_options_are_the_options_dataclass_field_for_field():
    """``DiLoCo(model, link, **options: Unpack[DiLoCoKwargs])``: what a type checker sees is what
    :class:`DiLoCoOptions` takes, names and types."""
    import dataclasses
    import typing

    from atoll.islands import DiLoCoOptions
    from atoll.islands._options import DiLoCoKwargs

    fields = typing.get_type_hints(DiLoCoOptions)
    assert typing.get_type_hints(DiLoCoKwargs) == {f.name: fields[f.name] for f in dataclasses.fields(DiLoCoOptions)}
    hint = typing.get_type_hints(DiLoCo.__init__, include_extras=True)["options"]
    assert typing.get_args(hint) == (DiLoCoKwargs,)
    with pytest.raises(TypeError, match="unexpected keyword argument 'overlap'"):
        DiLoCo(torch.nn.Linear(2, 2), CoordinatorLink("127.0.0.1:1", island_id="a"), overlap=2)


def test_an_h_the_run_overrides_is_warned_about_naming_both(start_server, caplog):
    srv = start_server(exact_config(run_id="t", sync_every=H))
    caplog.set_level(logging.WARNING, logger="atoll")
    sync = diloco(srv.address, sync_every=5).start()
    sync.close()
    assert any("sync_every=5 overrides the run's H=4" in r.getMessage() for r in caplog.records)


def test_codec_parameters_the_run_does_not_use_are_refused_at_join_naming_both(start_server):
    """The coordinator refuses the spec at Join, so the refused island never holds the θ_0 claim and
    the next island starts at once (refused on the island's side after joining, it waited a lease)."""
    srv = start_server(RunConfig(run_id="t", sync_every=H, codec="int8"))
    with pytest.raises(
        CoordinatorRefused, match=r"'int8:block=64,scale=fp32' was asked for; run 't' uses 'int8:block=256"
    ) as info:
        diloco(srv.address, codec="int8:block=64").start()
    assert info.value.reason is Reason.CODEC_MISMATCH
    assert srv.inspect(lambda s: (sorted(s.membership.islands), s.membership.bootstrapper)) == ([], None)
    sync = diloco(srv.address, codec="int8", island_id="v").start()  # a name alone takes the run's parameters
    assert srv.inspect(lambda s: s.membership.bootstrapper) == "v"  # the claim was free: v started at once
    sync.close()


def test_the_deprecated_form_runs_and_warns_once_naming_the_new_one(start_server):
    srv = start_server(exact_config(run_id="t", sync_every=H))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        diloco_module._legacy_warned = False
        model = model_fn()
        for island in ("old-a", "old-b"):
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            with DiLoCo(model, opt, coordinator=srv.address, run_id="t", island_id=island) as sync:
                run_rounds(sync, model, 1)
                assert sync.round == 1 + (island == "old-b") and sync.history[-1].tokens == 10 * H
    said = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(said) == 1 and "DiLoCo(model, CoordinatorLink(coordinator" in said[0], said
    with pytest.raises(TypeError, match="coordinator: these belong to the CoordinatorLink"):
        DiLoCo(model, CoordinatorLink(srv.address), coordinator=srv.address)


# ---- fast, clear failures ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("localhost", "has no port"),
        ("http://coord:7070", "without a scheme"),
        ("coord:http", "not host:port"),
        ("coord:99999", "outside 1..65535"),
        ("", "host:port"),
        ("a:1,,b", "'b' has no port"),
    ],
)
def test_malformed_addresses_raise_at_construction(address, says):
    with pytest.raises(ValueError, match=says):
        diloco(address)


def dead_address() -> str:
    import socket

    with socket.socket() as s:  # bound, never listening: connections are refused at once
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_an_unreachable_coordinator_warns_within_seconds_and_the_connect_deadline_holds():
    """A user's script with no logging setup: the warning reaches stderr (Python prints WARNING and up
    by default), within seconds; start() gives up at the deadline the user set."""
    script = textwrap.dedent(
        f"""
        import time, torch
        from atoll.islands import CoordinatorLink, DiLoCo
        started = time.monotonic()
        try:
            DiLoCo(torch.nn.Linear(2, 2), CoordinatorLink("{dead_address()}", connect_timeout_seconds=6)).start()
        except Exception as err:
            print(f"raised {{type(err).__name__}} after {{time.monotonic() - started:.1f}}s")
        """
    )
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert "unreachable for" in proc.stderr, proc.stderr
    raised = float(proc.stdout.split("after ")[1].rstrip("s\n"))
    assert 5.0 <= raised <= 12.0 and took < 30, proc.stdout


def test_a_long_wait_for_the_outer_step_says_what_the_round_waits_for(start_server, raw_island, monkeypatch, caplog):
    monkeypatch.setattr(session_module, "WAIT_WARN_SECONDS", 1.0)
    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=2, round_deadline_seconds=600))
    caplog.set_level(logging.WARNING, logger="atoll")
    sync = diloco(srv.address, pull_wait_seconds=0.5).start()
    other = raw_island(srv.address, "other", {"0.weight": (8, 6), "0.bias": (8,), "2.weight": (3, 8), "2.bias": (3,)})
    other.join()
    done = []
    worker = threading.Thread(target=lambda: done.append(run_rounds(sync, sync.model, 1)))
    worker.start()

    def waits():
        return [r.getMessage() for r in caplog.records if "for round 0's outer step" in r.getMessage()]

    wait_for(waits, what="the island's warning")
    model = model_fn()
    other.push({n: torch.zeros_like(p) for n, p in model.named_parameters()}, round_=0, tokens=10)
    worker.join(20)
    sync.close()
    assert "1 of quorum 2 committed, waiting for other" in waits()[0]


# ---- names of wrapped models -----------------------------------------------------------------------
def test_a_compiled_and_checkpoint_wrapped_island_joins_a_run_of_plain_islands(start_server):
    """(Before: ``_orig_mod.`` and ``_checkpoint_wrapped_module.`` made the names differ: refused.)"""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    srv = start_server(exact_config(run_id="t", sync_every=H, quorum=2))
    plain = diloco(srv.address, island_id="plain")
    inner = model_fn()
    inner[0] = checkpoint_wrapper(inner[0])
    wrapped_model = torch.compile(inner)  # compiled lazily: only the names matter here
    assert any("_orig_mod." in n and "_checkpoint_wrapped_module." in n for n, _ in wrapped_model.named_parameters())
    wrapped = diloco(srv.address, model=wrapped_model, island_id="wrapped")
    plain.start()
    wrapped.start()
    try:
        assert set(wrapped.global_params()) == {n for n, _ in plain.model.named_parameters()}
        for a, b in zip(plain.global_params().values(), wrapped.global_params().values(), strict=True):
            assert torch.equal(a, b)
    finally:
        plain.close()
        wrapped.close()


# ---- buffers -----------------------------------------------------------------------------------------
def bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))


def test_floating_point_buffers_are_averaged_over_the_islands(start_server):
    """(Before: BatchNorm's running statistics were never synced: same weights, different buffers.)"""
    srv = start_server(
        exact_config(
            run_id="t",
            sync_every=H,
            quorum=2,
            outer_lr=0.7,
            outer_momentum=0.9,
        )
    )
    islands = [diloco(srv.address, model=bn_model(), island_id=f"i{k}") for k in range(2)]
    for s in islands:
        s.start()
    before = islands[0].model[1].running_mean.clone()
    local = []
    threads = []

    def train(s, seed):
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.SGD(s.model.parameters(), lr=0.05)
        for step in range(H):
            x = torch.randn(16, 6, generator=gen) * (1 + seed)
            loss = s.model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == H - 1:
                local.append(s.model[1].running_mean.clone())
            s.step(tokens=16, loss=loss.item())

    for k, s in enumerate(islands):
        threads.append(threading.Thread(target=train, args=(s, k)))
        threads[-1].start()
    for t in threads:
        t.join(30)
    try:
        means = [s.model[1].running_mean for s in islands]
        assert torch.equal(means[0], means[1]) and not torch.equal(means[0], before)
        torch.testing.assert_close(means[0], (local[0] + local[1]) / 2, rtol=0, atol=1e-6)  # a plain mean
        assert torch.equal(islands[0].model[1].num_batches_tracked, torch.tensor(H))  # integer: stays local
    finally:
        for s in islands:
            s.close()


def test_buffers_can_be_left_out_but_not_by_half_the_run(start_server):
    srv = start_server(exact_config(run_id="t", sync_every=H))
    first = diloco(srv.address, model=bn_model(), island_id="a", sync_buffers=False).start()
    try:
        with pytest.raises(CoordinatorRefused, match="sync buffers the same way"):
            diloco(srv.address, model=bn_model(), island_id="b").start()
    finally:
        first.close()


# ---- tokens -----------------------------------------------------------------------------------------
def test_an_island_without_token_counts_weighs_its_steps_at_the_others_tokens_per_step(
    start_server, raw_island, caplog
):
    """The rule: an island that reports no tokens but took inner steps weighs steps x the tokens per
    step of the islands that report them (the last closed round's), and both sides warn. (Before: it
    weighed 1 token, 160x less than its share in the measured run.)"""
    srv = start_server(
        exact_config(
            run_id="t",
            sync_every=5,
            quorum=2,
            outer_lr=1.0,
            outer_momentum=0.0,
        )
    )
    caplog.set_level(logging.WARNING, logger="atoll")
    shapes = {"w": (2, 2)}
    a, b = raw_island(srv.address, "a", shapes), raw_island(srv.address, "b", shapes)
    a.join()
    b.join()
    a.push({"w": torch.zeros(2, 2)}, round_=0, kind=pb.PUSH_KIND_INIT)
    for r in range(2):
        a.push({"w": torch.full((2, 2), 1.0)}, round_=r, tokens=1000, loss=1.0, inner_steps=5)  # 200 per step
        b.push({"w": torch.full((2, 2), 4.0)}, round_=r, tokens=0, loss=1.0, inner_steps=5)
        a.pull(r)
    hist = srv.inspect(lambda s: s.history)
    assert hist[1]["tokens_by_island"] == {"a": 1000, "b": 0} and hist[1]["steps_by_island"] == {"a": 5, "b": 5}
    # Round 0 had no closed round to learn from but a's commit: b weighs 5 x 200 in both rounds, so the
    # mean Δ is (1 + 4) / 2 and, with outer lr 1 and no momentum, θ moves by -2.5 a round.
    theta = srv.inspect(lambda s: s.model.params["w"].clone())
    assert torch.allclose(theta, torch.full((2, 2), -5.0))
    assert any("island b reported no tokens for its 5 inner steps" in r.getMessage() for r in caplog.records)
    srv.inspect(lambda s: s.set_operational({"quorum": 1, "round_deadline_seconds": 0.5}))

    class W(torch.nn.Module):  # the run's model: one tensor "w"
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2, 2))

    sync = diloco(srv.address, model=W(), island_id="c", sync_every=1)
    sync.start()
    try:
        sync.step(loss=1.0)  # no tokens=
    finally:
        sync.close()
    assert any("step() got no tokens=" in r.getMessage() for r in caplog.records)


def test_the_island_that_uploads_theta0_does_not_pull_it_back_and_trains_from_it_exactly(start_server):
    """No byte sent twice: the bootstrapper does not pull θ_0 back right after uploading it (|θ| more on
    the wire per run). Its θ_start is the fp32 of its own θ, which is what it sent."""
    from support import H, batches, config, island

    srv = start_server(config())
    model, opt, sync = island(srv.address)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sync.start()
    assert srv.server.counters.bytes_out == 0  # nothing pulled: θ_0 is its own
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    theta0 = srv.inspect(lambda st: {k: v.clone() for k, v in st.model.params.items()})
    assert all(torch.equal(theta0[k], before[k]) for k in theta0)
    assert srv.inspect(lambda st: st.membership.islands["solo"].holds_round) == 0
    for b in batches(H):
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    sync.close()
    # One round: θ_1 = θ_0 + u from the island's own θ_start, the same on both ends.
    theta1 = srv.inspect(lambda st: {k: v.clone() for k, v in st.model.params.items()})
    assert all(torch.equal(v, theta1[k]) for k, v in model.state_dict().items())
