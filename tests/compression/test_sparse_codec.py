"""The ``sparse`` codec (issue 52, a first step): per-chunk top-k, b-bit odd levels, compact indices,
against a NumPy reference; its bytes; bad payloads refused with the codec's reason before anything
beyond the tensor's own size is allocated; an outer step through a coordinator."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from support import exact_config

from atoll.compression import codec_of, get_codec
from atoll.compression.sparse import BITMAP, ELIAS_FANO, OFFSETS, pack_bits, unpack_bits
from atoll.compression.wire import WireFormatError, pack, unpack
from atoll.protos import coordinator_pb2 as pb


def bf16(x: np.float32) -> np.float32:
    """fp32 rounded to the nearest bfloat16 (ties to even), in NumPy."""
    b = np.array([x], dtype=np.float32).view(np.uint32)
    b = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)) << np.uint32(16)
    return b.view(np.float32)[0]


def reference(x: np.ndarray, density: float, bits: int, chunk: int) -> np.ndarray:
    """What the payload decodes to, computed from the spec's description in NumPy (float32)."""
    flat = x.astype(np.float32).reshape(-1)
    k = min(chunk, max(1, round(density * chunk)))
    level = np.float32((1 << bits) - 1)
    out = np.zeros_like(flat)
    for start in range(0, flat.size, chunk):
        part = flat[start : start + chunk]
        keep_n = k if part.size == chunk else min(part.size, max(1, int(np.floor(k * part.size / chunk + 0.5))))
        keep = np.sort(np.argsort(-np.abs(part), kind="stable")[:keep_n])
        v = part[keep]
        s = bf16(np.float32(np.abs(v).max() / level))
        q = np.where(s > 0, v / (s if s > 0 else np.float32(1)), np.float32(0)).astype(np.float32)
        codes = np.clip(np.round((q + level) / np.float32(2)), 0, level)
        out[start + keep] = ((2 * codes - level) * s).astype(np.float32)
    return out.reshape(x.shape)


@pytest.mark.parametrize(
    "spec,shape",
    [
        ("sparse:density=0.01,bits=2,chunk=256", (3, 5000)),  # offsets, a ragged last chunk
        ("sparse:density=0.4,bits=2,chunk=64", (1000,)),  # a bitmap is smaller at this density
        ("sparse:density=0.25,bits=2,chunk=64", (1000,)),  # Elias-Fano ties the bitmap, and is taken
        ("sparse:density=0.05,bits=4,chunk=128", (7, 13)),  # fewer values than a chunk
        ("sparse:density=0.03125,bits=3,chunk=256", (5, 333)),  # Elias-Fano, a last chunk of its share
        ("sparse", (40_000,)),  # Elias-Fano
        ("sparse", (77,)),  # one short chunk keeps one value
    ],
)
def test_it_decodes_to_the_numpy_reference(spec, shape):
    codec = get_codec(spec)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    payload = codec.encode(x)
    assert len(payload) == codec.encoded_size(shape)  # known before encoding (a push header declares it)
    got = codec_of(payload).decode(payload, shape)
    want = reference(x.numpy(), codec.density, codec.bits, codec.chunk)
    np.testing.assert_array_equal(got.numpy(), want)
    acc = torch.ones(shape)
    codec_of(payload).decode_add_(payload, acc, alpha=0.5)
    np.testing.assert_allclose(acc.numpy(), 1 + 0.5 * want, rtol=0, atol=1e-6)
    assert codec.validate(payload, shape) >= float(np.linalg.norm(want)) * (1 - 1e-6)


def test_its_bytes_on_a_model_sized_tensor():
    """At the defaults (1/128 of the values, 2 bits, Elias-Fano indices in chunks of 4096: 7 low bits
    and 2 high bits an index, a bfloat16 scale a chunk): 368 bits a chunk of 4096, 0.0898 bits a value,
    356x fewer bytes than fp32, headers included."""
    codec = get_codec("sparse")
    assert codec.coding == ELIAS_FANO
    n = 3_300_000
    payload = codec.encode(torch.randn(n))
    assert 8 * len(payload) / n == pytest.approx((32 * (2 + 7) + 64 + 16) / 4096, rel=2e-3)
    assert 4 * n / len(payload) > 350


def test_a_3m_parameter_gpt_takes_300x_fewer_bytes_than_fp32():
    """The payloads of every tensor of a 3.2M-parameter GPT (69 tensors, 25 of them under a chunk:
    each keeps its share, at least one value), their wire headers included: at least 300x fewer
    bytes than fp32, with 2 KB to spare for a push's framing (~32 bytes a tensor)."""
    from atoll.models import TinyGPT, preset

    model = TinyGPT(preset("tiny", vocab_size=65, n_layer=4, n_embd=256))
    codec = get_codec("sparse")
    numel = sum(p.numel() for p in model.parameters())
    payloads = sum(codec.encoded_size(tuple(p.shape)) for p in model.parameters())
    assert numel > 3_000_000
    assert 4 * numel / (payloads + 32 * len(list(model.parameters()))) >= 300


@pytest.mark.parametrize("width", range(1, 17))
def test_bits_pack_little_end_first_and_back(width):
    """Every width a field may take, against NumPy's bit by bit packing, for counts that end mid-byte."""
    rng = np.random.default_rng(width)
    for count in (1, 7, 8, 9, 1001):
        values = rng.integers(0, 1 << width, count)
        bits = ((values[:, None] >> np.arange(width)) & 1).astype(np.uint8).reshape(-1)
        want = np.packbits(bits, bitorder="little")
        np.testing.assert_array_equal(pack_bits(torch.from_numpy(values), width).numpy(), want)
        np.testing.assert_array_equal(unpack_bits(torch.from_numpy(want), count, width).numpy(), values)


PARAMS = struct.Struct("<IIBB")


def forged(payload, params: bytes | None = None, body: bytes | None = None) -> bytearray:
    f = unpack(payload)
    return pack(f.codec_id, f.dtype, f.shape, bytes(f.params) if params is None else params,
                bytes(f.body) if body is None else body)  # fmt: skip


def refused(payload, shape, match: str, codec=None) -> None:
    with pytest.raises(WireFormatError, match=match):
        codec_of(payload).decode(payload, shape)
    with pytest.raises(WireFormatError, match=match):
        (codec or codec_of(payload)).validate(payload, shape)


def test_bad_payloads_are_refused_with_the_codecs_reason():
    codec = get_codec("sparse:density=0.05,bits=2,chunk=64")
    shape = (200,)  # chunks 64, 64, 64 and a tail of 8: k = 3 a chunk
    good = codec.encode(torch.randn(shape))
    f = unpack(good)
    chunk, k, bits, coding = PARAMS.unpack(bytes(f.params))
    assert coding == OFFSETS and (chunk, k, bits) == (64, 3, 2)
    body = bytearray(f.body)
    scales, codes = 4 * 2, -(-10 * 2 // 8)  # 4 bfloat16 scales; 3 values in each full chunk, 1 in the tail
    at = scales + codes
    offsets = [1, 5, 9, 2, 3, 4, 10, 20, 30, 0]

    def with_offsets(values) -> bytearray:
        return forged(good, body=bytes(body[:at]) + pack_bits(torch.tensor(values), 6).numpy().tobytes())

    assert codec_of(with_offsets(offsets)).decode(with_offsets(offsets), shape).count_nonzero() <= 10
    refused(with_offsets([1, 5, 9, 2, 3, 4, 10, 20, 30, 8]), shape, "outside its chunk")  # tail of 8
    refused(with_offsets([5, 1, 9, 2, 3, 4, 10, 20, 30, 0]), shape, "strictly increasing")  # unsorted
    refused(with_offsets([1, 1, 9, 2, 3, 4, 10, 20, 30, 0]), shape, "strictly increasing")  # duplicated
    refused(forged(good, PARAMS.pack(64, 4, 2, OFFSETS)), shape, "body is")  # counts disagree with the header
    refused(forged(good, PARAMS.pack(2**31, 3, 2, OFFSETS)), shape, "bad params")
    refused(forged(good, PARAMS.pack(64, 2**31, 2, OFFSETS)), shape, "bad params")
    refused(forged(good, PARAMS.pack(64, 3, 200, OFFSETS)), shape, "bad params")
    refused(forged(good, PARAMS.pack(64, 3, 2, 7)), shape, "bad params")
    dense = get_codec("sparse:density=0.4,bits=2,chunk=64")
    g = dense.encode(torch.randn(shape))
    fb = unpack(g)
    assert PARAMS.unpack(bytes(fb.params))[3] == BITMAP
    bad = bytearray(fb.body)
    bad[-1] ^= 0x01  # one more bit set in the tail's bitmap
    refused(forged(g, body=bytes(bad)), shape, "bitmap bits disagree with the header")
    other = get_codec("sparse:density=0.1,bits=2,chunk=64").encode(torch.randn(shape))
    codec_of(other).decode(other, shape)
    with pytest.raises(WireFormatError, match="not the run's sparse"):
        codec.validate(other, shape)


def test_an_outer_step_of_sparse_pushes_is_their_weighted_mean(start_server, raw_island):
    """Two islands push sparse payloads: θ_1 = θ_0 - (10 D(a) + 30 D(b)) / 40 (lr 1, no momentum), and a
    push of another sparse spec is refused."""
    spec = "sparse:density=0.05,bits=2,chunk=64"
    shapes = {"w": (20, 30), "b": (30,)}
    srv = start_server(
        exact_config(run_id="t", sync_every=1, quorum=2, outer_lr=1.0, outer_momentum=0.0, codec=spec,
                     downlink_codec="identity")
    )  # fmt: skip
    a, b = raw_island(srv.address, "a", shapes, codec=spec), raw_island(srv.address, "b", shapes, codec=spec)
    a.join()
    b.join()
    gen = torch.Generator().manual_seed(3)
    theta0 = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    a.push(theta0, round_=0, kind=pb.PUSH_KIND_INIT)
    da = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    db = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    with pytest.raises(Exception, match="not the run's sparse"):
        b.push(db, round_=0, tokens=30, codec="sparse:density=0.1,bits=2,chunk=64")
    a.push(da, round_=0, tokens=10)
    b.push(db, round_=0, tokens=30)
    a.pull(0)
    got = srv.inspect(lambda s: {k: v.clone() for k, v in s.model.params.items()})
    codec = get_codec(spec)
    for k in shapes:
        ra, rb = (reference(d[k].numpy(), codec.density, codec.bits, codec.chunk) for d in (da, db))
        np.testing.assert_allclose(got[k].numpy(), theta0[k].numpy() - (10 * ra + 30 * rb) / 40, atol=1e-5)


def test_bad_elias_fano_indices_are_refused():
    """Elias-Fano (chunks of 256 keeping 8: 5 low bits and 16 high bits each; a last chunk of 88
    keeping 3): a set high bit too many or too few, one moved into the next chunk's span, a high bit
    past the chunk, or two offsets the same: each refused with its reason."""
    codec = get_codec("sparse:density=0.03125,bits=2,chunk=256")
    shape = (600,)
    good = codec.encode(torch.randn(shape, generator=torch.Generator().manual_seed(1)))
    assert PARAMS.unpack(bytes(unpack(good).params))[3] == ELIAS_FANO
    lay = codec.layout(600)
    assert (lay.k, lay.low, lay.span, lay.tail_k, lay.total) == (8, 5, 16, 3, 19)
    body = bytes(unpack(good).body)
    low = np.unpackbits(np.frombuffer(body[lay.index_at : lay.high_at], np.uint8), bitorder="little")
    high = np.unpackbits(np.frombuffer(body[lay.high_at :], np.uint8), bitorder="little")[: 2 * 16 + lay.tail_span]

    def with_bits(high_bits, low_bits=low) -> bytearray:
        packed = (
            np.packbits(low_bits, bitorder="little").tobytes() + np.packbits(high_bits, bitorder="little").tobytes()
        )
        return forged(good, body=body[: lay.index_at] + packed)

    np.testing.assert_array_equal(codec.decode(with_bits(high), shape), codec.decode(good, shape))
    ones = np.flatnonzero(high)
    extra = high.copy()
    extra[np.flatnonzero(high == 0)[0]] = 1
    refused(with_bits(extra), shape, "high bits disagree with the header")
    fewer = high.copy()
    fewer[ones[0]] = 0
    refused(with_bits(fewer), shape, "high bits disagree with the header")
    # a set bit inside the next chunk's span: chunk 1 holds 9, chunk 0 holds 7
    crossing = high.copy()
    crossing[ones[7]] = 0
    crossing[16 + np.flatnonzero(high[16:32] == 0)[0]] = 1
    refused(with_bits(crossing), shape, "disagree with its count")
    past = np.zeros_like(high)  # chunk 0: offsets' high parts 8 (the largest is 255 >> 5 = 7) onwards
    past[ones[8:]] = high[ones[8:]]
    past[8 : 8 + 8] = 1
    refused(with_bits(past), shape, "outside its chunk")
    same = low.copy()  # chunk 0's first two offsets in one high bucket with one low part
    first_two = high.copy()
    first_two[ones[:8]] = 0
    first_two[[0, 1, 3, 5, 7, 9, 11, 13]] = 1  # high parts 0, 0, 1, 2, 3, 4, 5, 6
    same[0:5] = same[5:10]
    refused(with_bits(first_two, same), shape, "strictly increasing")


@pytest.mark.parametrize("spec", ["int8", "sparse", "sparse:density=0.05,bits=3,chunk=64"])
def test_error_feedback_subtracts_what_was_sent_as_each_chunk_is_encoded(spec):
    """Error feedback around a chunked codec takes each chunk's decoded values as it is encoded, with
    no decode of the payload: its residual is bit for bit x + βe − decode(payload), round after round;
    and the caller's x is never written into (it was, on the first round, through a view of it)."""
    from atoll.compression import ErrorFeedback

    codec, gen = get_codec(spec), torch.Generator().manual_seed(7)
    ef, state, residual = ErrorFeedback(codec, 0.5), {}, None
    for _ in range(3):
        x = torch.randn(3, 3000, generator=gen)
        x.view(-1)[:10] = -0.0
        given = x.clone()
        payload = ef.encode(x, state)
        assert x.numpy().tobytes() == given.numpy().tobytes()
        want = x.clone() if residual is None else torch.add(x, residual, alpha=0.5)
        want -= codec.decode(payload, (3, 3000))
        assert state["residual"].numpy().tobytes() == want.numpy().tobytes()
        residual = want
    assert residual.abs().sum() > 0


def test_adding_an_update_at_its_indices_is_bit_for_bit_adding_its_decode():
    """An island adds a sparse update in O(K) (``add_decoded_``: the kept values at their indices); the
    coordinator makes θ_{r+1} = decode(u) + θ_r: the same bits, -0.0 and +0.0 in θ included (a
    decode holds -0.0 where nothing was kept)."""
    codec = get_codec("sparse:density=0.05,chunk=64")
    assert codec.adds_exactly
    gen = torch.Generator().manual_seed(2)
    theta = torch.randn(5000, generator=gen)
    theta[:300:3], theta[1:300:3] = -0.0, 0.0
    payload = codec.encode(torch.randn(5000, generator=gen))
    coordinator = codec.decode(payload, (5000,)) + theta
    island = codec.add_decoded_(payload, theta.clone())
    assert island.numpy().tobytes() == coordinator.numpy().tobytes()
    assert (torch.signbit(island[:300:3]) | (island[:300:3] != 0)).all()  # -0.0 stayed -0.0


@pytest.mark.parametrize("spec", ["int8", "sparse", "sparse:density=0.05,bits=3,chunk=64"])
def test_error_feedback_of_a_difference_is_made_in_the_residuals_own_storage(spec):
    """An island's ``encode_difference(θ_start, θ)`` around a chunked codec makes β·e + (a − b) a chunk
    at a time in e's storage (nothing of |θ| allocated after the first round): with β = 1 the payloads
    and residuals are the bits of encode(a − b), round after round, θ in bf16 too."""
    from atoll.compression import ErrorFeedback

    codec, gen = get_codec(spec), torch.Generator().manual_seed(9)
    fused, plain = ErrorFeedback(codec), ErrorFeedback(codec)
    s_fused, s_plain = {}, {}
    for r in range(3):
        a = torch.randn(3, 3000, generator=gen)
        b = torch.randn(3, 3000, generator=gen).to(torch.bfloat16 if r == 1 else torch.float32)
        got = fused.encode_difference(a, b, s_fused)
        want = plain.encode(a.float() - b.float(), s_plain)
        assert bytes(got) == bytes(want)
        if r == 0:  # (the first e: 0 + d against d, equal up to the sign of a zero)
            assert torch.equal(s_fused["residual"], s_plain["residual"])
        else:
            assert s_fused["residual"].numpy().tobytes() == s_plain["residual"].numpy().tobytes()
    residual = s_fused["residual"]
    assert fused.encode_difference(a, b, s_fused) is not None and s_fused["residual"] is residual  # reused


def test_a_payload_checked_once_is_not_checked_again_where_it_is_used(monkeypatch):
    """The coordinator validates a push's entry as it arrives and adds it into the sum later; an island
    checks an update's entry and then applies it: the O(K) check of the indices runs once, not again at
    the use (``verified=True``). Unverified, a payload is still checked, and forged indices still
    refused, at every entry point."""
    from atoll.compression.sparse import SparseCodec

    codec = get_codec("sparse:density=0.03125,bits=2,chunk=256")
    shape = (600,)
    good = codec.encode(torch.randn(shape, generator=torch.Generator().manual_seed(2)))
    checks = []
    real = SparseCodec._check
    monkeypatch.setattr(SparseCodec, "_check", lambda self, frame: (checks.append(1), real(self, frame))[1])
    codec.validate(good, shape)  # on arrival
    acc = torch.zeros(shape)
    codec.decode_add_(good, acc, alpha=2.0, verified=True)  # into the sum
    codec.add_decoded_(good, acc, verified=True)
    codec.norm_bound(good, shape, verified=True)
    assert len(checks) == 1
    np.testing.assert_array_equal(acc.numpy(), (3 * codec.decode(good, shape)).numpy())
    assert len(checks) == 2  # (decode without verified: checked)
    lay = codec.layout(600)
    body = bytearray(unpack(good).body)
    body[lay.high_at] ^= 0xFF  # the first chunk's high bits: its count no longer adds up
    bad = forged(good, body=bytes(body))
    refused(bad, shape, "disagree")
    with pytest.raises(WireFormatError, match="disagree"):
        codec.decode_add_(bad, torch.zeros(shape))
