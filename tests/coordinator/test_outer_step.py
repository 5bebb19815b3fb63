"""The coordinator's outer step against a NumPy reference of (Nesterov) outer SGD."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from support import exact_config
from support.reference import numpy_outer_sgd

from atoll.compression import get_codec
from atoll.coordinator.run.options import LimitsOptions
from atoll.coordinator.state.outer import NesterovSGD, outer_step_
from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (3, 5), "b": (7,), "emb": (4, 2, 3)}


def decode_update(header, payloads, have):
    codec = get_codec(header.codec)
    out = {}
    for name, payload in payloads:
        value = codec.decode(payload, SHAPES[name])
        out[name] = value if header.kind == pb.UPDATE_KIND_FULL else have[name] + value
    return out


@pytest.mark.parametrize(("nesterov", "tensor_workers"), [(True, 1), (False, 1), (True, 3)])
def test_outer_step_matches_numpy_reference(start_server, raw_island, nesterov, tensor_workers):
    """(With ``tensor_workers`` 3 the pushes are decoded and the step made on three threads.)"""
    lr, mu = 0.7, 0.9
    srv = start_server(
        exact_config(
            run_id="t",
            sync_every=1,
            outer_lr=lr,
            outer_momentum=mu,
            nesterov=nesterov,
            quorum=3,
        ),
        limits=LimitsOptions(tensor_workers=tensor_workers),
    )
    assert srv.inspect(lambda s: s.model.workers.count) == tensor_workers
    rng = np.random.default_rng(0)
    theta0 = {k: torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()}
    islands = [raw_island(srv.address, f"i{k}", SHAPES) for k in range(3)]
    assert islands[0].join().bootstrap
    assert not islands[1].join().bootstrap
    islands[2].join()
    assert islands[0].push(theta0, round_=0, kind=pb.PUSH_KIND_INIT).committed

    have = {i.island_id: decode_update(*i.pull(-1), None) for i in islands}
    for held in have.values():
        for k in SHAPES:
            assert torch.equal(held[k], theta0[k])

    ref_theta = {k: v.numpy().astype(np.float64) for k, v in theta0.items()}
    ref_m = {k: np.zeros(s) for k, s in SHAPES.items()}
    for r in range(4):
        tokens = [100 + 50 * r, 300, 7 * (r + 1)]
        deltas = [{k: rng.standard_normal(s).astype(np.float32) * 0.1 for k, s in SHAPES.items()} for _ in islands]
        for isl, d, t in zip(islands, deltas, tokens, strict=True):
            resp = isl.push({k: torch.from_numpy(v) for k, v in d.items()}, round_=r, tokens=t)
            assert resp.committed and not resp.duplicate
        ref_theta, ref_m = numpy_outer_sgd(ref_theta, ref_m, deltas, tokens, lr=lr, mu=mu, nesterov=nesterov)
        for isl in islands:
            header, payloads = isl.pull(r)
            assert header.kind == pb.UPDATE_KIND_DELTA and header.round == r + 1
            have[isl.island_id] = decode_update(header, payloads, have[isl.island_id])
        coord_theta = srv.inspect(lambda s: {k: v.clone() for k, v in s.model.params.items()})
        for k in SHAPES:
            np.testing.assert_allclose(coord_theta[k].numpy(), ref_theta[k], atol=1e-6, rtol=0)
            for isl in islands:  # every island holds bitwise the coordinator's θ
                assert torch.equal(have[isl.island_id][k], coord_theta[k])


def test_momentum_is_persisted_and_pull_full_is_bitwise(start_server, raw_island, tmp_path):
    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=1))
    isl = raw_island(srv.address, "a", SHAPES)
    isl.join()
    theta0 = {k: torch.randn(s) for k, s in SHAPES.items()}
    isl.push(theta0, round_=0, kind=pb.PUSH_KIND_INIT)
    isl.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, tokens=5)
    header, payloads = isl.pull(0)
    delta_theta = decode_update(header, payloads, theta0)
    full_header, full_payloads = isl.pull(-1)
    assert full_header.kind == pb.UPDATE_KIND_FULL and full_header.round == 1
    full = decode_update(full_header, full_payloads, None)
    for k in SHAPES:
        assert torch.equal(full[k], delta_theta[k])
    from atoll.coordinator.disk import snapshots

    # The optimizer state is written in the background after the publish: wait for that write (the
    # pull returned at the publish; a CI run read the dir before it and found θ_0's zero momentum).
    m = srv.inspect(lambda s: (s.writer.wait(), {k: v.clone() for k, v in s.model.optimizer.buffers.items()})[1])
    snap = snapshots.load(tmp_path / "state")
    assert snap.round == 1
    for k in SHAPES:
        assert torch.equal(snap.params[k], full[k])
        assert torch.equal(snap.extra[f"momentum/{k}"], m[k])
        assert m[k].abs().sum() > 0


# ---- the outer step ---------------------------------------------------------------------------
@pytest.mark.parametrize("downlink", ["identity", "int8", "sparse", "sparse:density=0.05,chunk=64"])
def test_outer_step_in_place_matches_numpy(downlink):
    rng = np.random.default_rng(0)
    shapes = {"w": (5, 3), "bn.running_mean": (3,)}
    theta = {k: torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()}
    deltas = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(2)]
    weights = [3.0, 1.0]
    accum = {k: torch.zeros(s) for k, s in shapes.items()}
    for w, d in zip(weights, deltas, strict=True):
        for k in shapes:
            accum[k].add_(torch.from_numpy(d[k]), alpha=w)
    opt = NesterovSGD({"w": shapes["w"]}, lr=0.7, momentum=0.9, nesterov=True)
    codec = get_codec(downlink)
    ef = {k: torch.zeros(s) for k, s in shapes.items()}
    payloads = outer_step_(
        accum,
        theta,
        weight_total=4.0,
        optimizer=opt,
        buffers=frozenset({"bn.running_mean"}),
        downlink=codec,
        downlink_ef=ef,
        downlink_state={},
    )
    g = {k: (3 * deltas[0][k] + deltas[1][k]).astype(np.float64) / 4 for k in shapes}
    u = {"w": -0.7 * (g["w"] + 0.9 * g["w"]), "bn.running_mean": -g["bn.running_mean"]}  # m = g after one step
    for k in shapes:
        sent = codec.decode(payloads[k], shapes[k])
        assert torch.equal(accum[k], theta[k] + sent)  # exactly what an island adds to θ_r
        np.testing.assert_allclose(sent.numpy() + ef[k].numpy(), u[k], atol=1e-5)
        if downlink == "identity":
            assert not ef[k].any()
    np.testing.assert_allclose(opt.buffers["w"].numpy(), g["w"], atol=1e-6)


@pytest.mark.parametrize(
    "downlink",
    ["identity", "int8", "int4", "bf16", "fp16", "sparse", "sparse:density=0.05,chunk=64", "topk:fraction=0.1"],
)
def test_outer_step_made_chunk_by_chunk_or_on_workers_is_bitwise_the_whole_tensor_one(downlink):
    """A chunked codec gets each tensor's outer step a cache-sized chunk at a time (one pass over θ,
    momentum and the error feedback instead of ten), and the step runs on several tensor workers at
    once: θ_{r+1}, the payloads, the momentum and the error feedback are the bits of the whole-tensor
    step on one thread, round after round, over tensors of several chunks with a ragged end, a buffer,
    an empty tensor and a round of robust aggregation; ``made`` sees θ's order, on the calling thread."""
    from atoll.compression.base import CHUNK
    from atoll.coordinator.state.workers import SERIAL, TensorWorkers
    from benchmarks.outer_step import Whole  # a codec made to read its input whole

    shapes = {"big": (CHUNK // 1000 + 3, 1001), "w": (37, 5), "bn.running_mean": (300,), "empty": (0, 4)}
    gen = torch.Generator().manual_seed(0)
    theta0 = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    theta0["w"].view(-1)[:50] = -0.0  # where updates too small for their block's scale land: -0.0 + 0
    codecs = {"chunks": get_codec(downlink), "whole": Whole(get_codec(downlink)), "workers": get_codec(downlink)}
    pools = {"chunks": SERIAL, "whole": SERIAL, "workers": TensorWorkers(3)}
    theta = {c: {k: v.clone() for k, v in theta0.items()} for c in codecs}
    momentum = {
        c: NesterovSGD({k: shapes[k] for k in ("big", "w", "empty")}, lr=0.7, momentum=0.9, nesterov=True)
        for c in codecs
    }
    ef = {c: {k: torch.zeros(s) for k, s in shapes.items()} for c in codecs}
    state = {c: {} for c in codecs}

    def bits(tensors: dict) -> dict:
        return {k: v.numpy().tobytes() for k, v in tensors.items()}

    for r in range(3):
        accum = {k: torch.randn(s, generator=gen) * 0.01 for k, s in shapes.items()}
        accum["w"].view(-1)[:50] = torch.tensor([1e-9, -1e-9]).repeat(25)
        robust = {k: torch.randn(s, generator=gen) * 0.01 for k, s in shapes.items()} if r == 1 else None
        sent = {}
        for c, codec in codecs.items():
            acc = {k: v.clone() for k, v in accum.items()}
            seen = []
            payloads = outer_step_(
                acc,
                theta[c],
                weight_total=3.0,
                optimizer=momentum[c],
                buffers=frozenset({"bn.running_mean"}),
                downlink=codec,
                downlink_ef=ef[c],
                downlink_state=state[c],
                robust_grads=None if robust is None else dict(robust),
                made=lambda name, _, seen=seen: seen.append(
                    (name, threading.current_thread() is threading.main_thread())
                ),
                workers=pools[c],
            )
            assert seen == [(k, True) for k in shapes]
            sent[c] = {k: bytes(p) for k, p in payloads.items()}
            for k in shapes:  # exactly what an island adds to θ_r
                assert torch.equal(acc[k], theta[c][k] + codec.decode(payloads[k], shapes[k]))
            theta[c] = acc
        for c in ("chunks", "workers"):
            assert sent[c] == sent["whole"], (c, r)
            assert bits(theta[c]) == bits(theta["whole"]), (c, r)
            assert bits(ef[c]) == bits(ef["whole"]), (c, r)
            assert bits(momentum[c].buffers) == bits(momentum["whole"].buffers), (c, r)
    pools["workers"].close()
    assert any(e.abs().sum() > 0 for e in ef["chunks"].values()) == get_codec(downlink).lossy
