"""Codec error bounds, wire-format round trips, corrupt payloads, error feedback."""

import contextlib
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.compression import ErrorFeedback, WireFormatError, available_codecs, get_codec
from atoll.compression import dct as dct_mod
from atoll.compression import topk as topk_mod
from atoll.compression.wire import MAGIC, pack, unpack

SIZES = [1, 7, 255, 256, 257, 1000, 4099]
MAGNITUDES = [1e-8, 1e-3, 1.0, 1e4]
ALL_SPECS = [
    "identity",
    "fp16",
    "bf16",
    "int8",
    "int8:scale=fp16,block=64",
    "int4",
    "int4:scale=fp16",
    "int2",
    "int2:block=32",
    "topk:fraction=0.01",
    "topk:fraction=0.3,values=fp16",
    "dcttopk:fraction=0.01",
    "dcttopk:fraction=0.3,values=fp16,chunk=16",
    "powersgd:rank=2",
]


def blocks_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.numel()
    pad = (-n) % block
    xb = torch.nn.functional.pad(x.abs().reshape(-1), (0, pad)).view(-1, block)
    return xb.amax(1).repeat_interleave(block)[:n]


def blockwise_bound(x: torch.Tensor, codec) -> torch.Tensor:
    qmax = (1 << (codec.bits - 1)) - 1
    amax = blocks_absmax(x, codec.block)
    if codec.scale == "fp32":  # plus two fp32 ulps of the value: the decoded code x scale is rounded itself
        return amax * (0.5 / qmax) * (1 + 1e-5) + x.abs() * 2.0**-22 + 1e-30
    return amax * (0.5 / qmax + 1e-3) + x.abs().max() * 1e-7 + 1e-30


def error_bound(spec: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(spec)
    a = x.abs()
    if spec == "identity":
        return a * 2.0**-24
    if spec == "fp16":
        return torch.maximum(a * 2.0**-11, torch.tensor(2.0**-25))
    if spec == "bf16":
        return a * 2.0**-8
    return blockwise_bound(x, codec)


DENSE_SPECS = [s for s in ALL_SPECS if not s.startswith(("topk", "dcttopk", "powersgd"))]


@pytest.mark.parametrize("spec", DENSE_SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_dense_codec_error_bounds(spec, dtype):
    codec = get_codec(spec)
    gen = torch.Generator().manual_seed(1)
    for n in SIZES:
        for mag in MAGNITUDES:
            if spec == "fp16" and dtype == torch.bfloat16 and mag > 6e4:
                continue
            x = (torch.randn(n, generator=gen, dtype=torch.float64) * mag).to(dtype)
            if dtype in (torch.float16,) and mag < 1e-4:
                continue  # not representable in the input dtype itself
            ref = x.to(torch.float32)
            y = codec.decode(codec.encode(x), (n,))
            assert y.dtype == torch.float32 and y.shape == (n,)
            err = (y.double() - x.double()).abs()
            bound = error_bound(spec, x.double()).double()
            assert bool((err <= bound).all()), (spec, dtype, n, mag, float((err - bound).max()))
            assert torch.isfinite(y).all() and ref.shape == y.shape


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("kind", ["zeros", "constant", "empty", "scalar-like"])
def test_degenerate_tensors(spec, kind):
    codec = get_codec(spec)
    x = {
        "zeros": torch.zeros(3, 333),
        "constant": torch.full((3, 333), -2.5),
        "empty": torch.zeros(0, 5),
        "scalar-like": torch.tensor([3.25]),
    }[kind]
    y = codec.decode(codec.encode(x, {}), tuple(x.shape))
    assert y.shape == x.shape
    if kind == "constant" and spec.startswith("topk"):
        kept = (y != 0).sum().item()
        assert kept == max(1, round(codec.fraction * x.numel()))
        assert torch.allclose(y[y != 0], torch.tensor(-2.5), rtol=1e-2)
    elif kind == "constant" and spec.startswith("dcttopk"):
        # A constant block is one DC coefficient: 3 x 333 is 9 blocks of 3 x 37 (chunk 16: 37 of 3 x 9) <= k.
        torch.testing.assert_close(y, x, rtol=1e-2, atol=1e-2)
    elif kind == "constant" and spec.startswith("powersgd"):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)  # rank 1: exact up to float error
    else:
        torch.testing.assert_close(y, x, rtol=1e-2, atol=0)


REAL_TOPK = torch.topk


def count_topk(monkeypatch) -> list[int]:
    """The sizes of the tensors the top-k codec runs torch.topk on, from now on."""
    calls = []

    def spy(t, k, *a, **kw):
        calls.append(t.numel())
        return REAL_TOPK(t, k, *a, **kw)

    monkeypatch.setattr(topk_mod.torch, "topk", spy)
    return calls


def test_topk_whose_sampled_threshold_overshoots_lowers_it_by_the_sample_not_blindly(monkeypatch):
    """The strided sample sees only large values (they sit on its stride): the first threshold keeps
    far fewer than k. The next one comes from the sample at twice the share, not a quarter of the
    value (which kept every large value, ~65k candidates, for k = 1000, and made the last top-k 33x
    as long as k)."""
    n, k = 1_000_003, 1000
    stride = n // topk_mod.SAMPLE
    gen = torch.Generator().manual_seed(4)
    x = torch.rand(n, generator=gen) * 0.01
    x[::stride] = 10.0 + torch.rand(x[::stride].numel(), generator=gen)
    calls = count_topk(monkeypatch)
    idx = topk_mod.select_topk(x, k)
    assert torch.equal(idx, REAL_TOPK(x.abs(), k).indices.sort().values)
    assert all(c < 2 * k + 10 for c in calls), f"topk ran on {calls} elements, k={k}"


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.05])
def test_topk_selects_the_largest_without_full_sort(fraction, monkeypatch):
    n = 1_000_003  # above the size where the sampled-threshold path runs
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 3
    calls = count_topk(monkeypatch)
    codec = get_codec(f"topk:fraction={fraction}")
    y = codec.decode(codec.encode(x), (n,))
    k = round(fraction * n)
    kept = y != 0
    assert int(kept.sum()) == k
    assert all(c < 2 * k + 10 for c in calls), f"topk ran on {calls} elements, k={k}"
    expected = REAL_TOPK(x.abs(), k).values
    torch.testing.assert_close(x[kept].abs().sort(descending=True).values, expected)
    assert float(x[~kept].abs().max()) <= float(x[kept].abs().min())
    # values are int8 over blocks of 256 kept values: error <= block absmax / 254
    err = (y[kept] - x[kept]).abs()
    assert float(err.max()) <= float(x[kept].abs().max()) / 254 * (1 + 1e-5)


def test_topk_small_tensors_and_index_widths():
    for n in [10, 1 << 15, (1 << 15) + 1]:
        x = torch.randn(n)
        codec = get_codec("topk:fraction=0.1")
        payload = codec.encode(x)
        k = max(1, round(0.1 * n))
        width = 2 if n <= 1 << 15 else 4
        assert len(payload) < k * (width + 1.1) + 200
        y = codec.decode(payload, (n,))
        assert int((y != 0).sum()) == k


def reference_block_dct(c: np.ndarray, br: int, bc: int, inverse: bool = False) -> np.ndarray:
    """Orthonormal 2-D DCT-II (or its inverse) of every br x bc block, from the definition (float64)."""

    def basis(n):
        k, i = np.arange(n)[:, None], np.arange(n)[None, :]
        m = np.cos(np.pi * (i + 0.5) * k / n) * np.sqrt(2.0 / n)
        m[0] /= np.sqrt(2.0)
        return m

    a, b = basis(br), basis(bc)
    out = np.empty_like(c)
    for r in range(0, c.shape[0], br):
        for col in range(0, c.shape[1], bc):
            blk = c[r : r + br, col : col + bc]
            out[r : r + br, col : col + bc] = a.T @ blk @ b if inverse else a @ blk @ b.T
    return out


def test_dcttopk_keeps_the_largest_block_dct_coefficients():
    """130 x 200 at chunk 64: rows in blocks of 64 (130 has no divisor in (32, 64], so the rows
    are padded to 3 blocks, 192), cols in blocks of 50. The payload holds the top-k coefficients of
    an independent float64 block DCT, and the decode is their inverse."""
    x = torch.randn(130, 200, generator=torch.Generator().manual_seed(5)) + torch.linspace(-2, 2, 200)
    codec = get_codec("dcttopk:fraction=0.02,values=fp16")
    padded = np.zeros((192, 200))
    padded[:130] = x.double().numpy()
    coef = reference_block_dct(padded, 64, 50)
    k = round(0.02 * x.numel())
    keep = np.argsort(-np.abs(coef).ravel())[:k]
    payload = codec.encode(x)
    y = codec.decode(payload, (130, 200))
    frame = unpack(payload)
    width = frame.params[8]
    sent = np.frombuffer(bytes(frame.body[: k * width]), dtype=np.uint16 if width == 2 else np.uint32)
    assert sorted(sent.tolist()) == sorted(keep.tolist())
    # Parseval: the error energy is the dropped coefficients' energy (values are fp16: ~1e-3 rel.)
    dropped = float((coef**2).sum() - (coef.ravel()[keep] ** 2).sum())
    err = float(((y.double().numpy() - x.double().numpy()) ** 2).sum())
    assert abs(err - dropped) <= 1e-2 * dropped + 1e-3 * float((coef**2).sum()), (err, dropped)


@pytest.mark.parametrize(
    "shape, blocks, padded",
    [((130, 200), (64, 50), (192, 200)), ((128, 120), (64, 60), (128, 120)), ((1, 300), (1, 60), (1, 300))],
)
def test_dcttopk_decode_and_decode_add_are_the_inverse_of_the_sent_coefficients(shape, blocks, padded):
    """Padded (130 rows) and unpadded layouts decode through different paths (the unpadded one
    writes its last GEMM straight into the output); both must equal a float64 inverse DCT of the
    coefficients on the wire, into a fresh tensor and accumulated with alpha into a non-zero one."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(*shape, generator=gen)
    codec = get_codec("dcttopk:fraction=0.05,values=fp16")
    payload = codec.encode(x)
    frame = unpack(payload)
    k, width, kind = struct.unpack_from("<QBB", bytes(frame.params))
    coef = np.zeros(padded[0] * padded[1])
    coef[topk_mod.read_indices(frame.body, k, width).numpy()] = topk_mod.read_values(frame.body, k, width, kind)
    expected = reference_block_dct(coef.reshape(padded), *blocks, inverse=True)[: shape[0], : shape[1]]
    y = codec.decode(payload, shape)
    np.testing.assert_allclose(y.numpy(), expected, rtol=0, atol=1e-5)
    acc = torch.randn(*shape, generator=gen)
    start = acc.double().numpy()
    codec.decode_add_(payload, acc, alpha=-0.5)
    np.testing.assert_allclose(acc.numpy(), start - 0.5 * expected, rtol=0, atol=1e-5)


def test_dcttopk_beats_raw_topk_on_row_and_column_structure():
    """Pseudo-gradients of Adam-trained matrices carry per-row/per-column offsets; the block DCT
    packs them into few coefficients, raw top-k cannot."""
    gen = torch.Generator().manual_seed(2)
    rows, cols = torch.randn(256, 1, generator=gen), torch.randn(1, 512, generator=gen)
    x = rows + cols + 0.5 * torch.randn(256, 512, generator=gen)

    def rel_err(spec):
        codec = get_codec(spec)
        return float((codec.decode(codec.encode(x), x.shape) - x).norm() / x.norm())

    raw, dct = rel_err("topk:fraction=0.01"), rel_err("dcttopk:fraction=0.01")
    assert dct < 0.75 * raw, (dct, raw)
    assert len(get_codec("dcttopk:fraction=0.01").encode(x)) <= len(get_codec("topk:fraction=0.01").encode(x)) + 8


def test_powersgd_warm_start_recovers_low_rank_and_never_exceeds_norm():
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(64, 3, generator=gen) @ torch.randn(3, 48, generator=gen)  # exactly rank 3
    codec = get_codec("powersgd:rank=3")
    state = {}
    errs = []
    for _ in range(3):
        y = codec.decode(codec.encode(m, state), (64, 48))
        errs.append(float((y - m).norm() / m.norm()))
    assert errs[-1] < 1e-4, errs
    noise = torch.randn(64, 48, generator=gen)
    y = codec.decode(codec.encode(noise, {}), (64, 48))
    assert float((noise - y).norm()) <= float(noise.norm()) * (1 + 1e-5)  # a projection
    assert len(codec.encode(noise, {})) < 4 * 3 * (64 + 48) + 100


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_decode_add_matches_decode(spec):
    codec = get_codec(spec)
    x = torch.randn(37, 29)
    payload = codec.encode(x, {})
    acc = torch.randn(37, 29)
    expected = acc + 0.25 * codec.decode(payload, (37, 29))
    codec.decode_add_(payload, acc, alpha=0.25)
    torch.testing.assert_close(acc, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="contiguous float32"):
        codec.decode_add_(payload, torch.zeros(29, 37).t())


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_two_weighted_contributions_sum_the_same_in_either_order(spec):
    """The coordinator adds each island's weighted delta as its push arrives. ``decode_add_`` rounds
    ``alpha * decode`` on its own before adding it (no fused multiply-add into the accumulator), so a
    round of two islands gives bitwise the same mean whichever pushed first: what makes a run
    reproducible across processes. Larger shapes reach the chunked and GEMM paths."""
    codec = get_codec(spec)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(300, 257, generator=gen), torch.randn(300, 257, generator=gen) * 1e-3
    pa, pb = codec.encode(a, {}), codec.encode(b, {})
    wa, wb = 1 / 3, 0.7071

    def total(first, second):
        acc = torch.zeros(300, 257)
        codec.decode_add_(first[0], acc, alpha=first[1])
        codec.decode_add_(second[0], acc, alpha=second[1])
        return acc

    ab, ba = total((pa, wa), (pb, wb)), total((pb, wb), (pa, wa))
    assert torch.equal(ab, ba), f"{int((ab != ba).sum())} elements differ"
    expected = (codec.decode(pa, (300, 257)) * wa) + (codec.decode(pb, (300, 257)) * wb)
    assert torch.equal(ab, expected)


def test_wire_round_trip_and_header_errors():
    body = np.arange(12, dtype=np.float32)
    payload = pack(1, torch.float16, (3, 4), b"\x01\x02", body)
    frame = unpack(payload)
    assert (frame.codec_id, frame.dtype, frame.shape, bytes(frame.params)) == (1, torch.float16, (3, 4), b"\x01\x02")
    assert np.array_equal(np.frombuffer(frame.body, dtype=np.float32), body)
    assert bytes(payload[:4]) == MAGIC
    bad_version = bytearray(payload)
    bad_version[4] = 99
    with pytest.raises(WireFormatError, match="wire version 99"):
        unpack(bad_version)
    with pytest.raises(WireFormatError, match="bad magic"):
        unpack(b"XXXX" + bytes(payload[4:]))
    with pytest.raises(WireFormatError, match="more than the 11 allowed"):
        unpack(payload, max_numel=11)
    with pytest.raises(WireFormatError, match="trailing"):
        unpack(bytes(payload) + b"\0")


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_every_decoder_rejects_corrupt_and_truncated_payloads(spec):
    codec = get_codec(spec)
    x = torch.randn(50, 40)
    payload = bytes(codec.encode(x, {}))
    rng = np.random.default_rng(0)
    for cut in sorted({0, 1, 3, 8, 20, len(payload) // 2, len(payload) - 5, len(payload) - 1}):
        with pytest.raises(WireFormatError):
            codec.decode(payload[:cut], (50, 40))
    for pos in rng.choice(len(payload), size=min(60, len(payload)), replace=False):
        bad = bytearray(payload)
        bad[pos] ^= 1 << int(rng.integers(8))
        with pytest.raises(WireFormatError):
            codec.decode(bytes(bad), (50, 40))
    with pytest.raises(WireFormatError, match="shape"):
        codec.decode(payload, (40, 50))
    other = get_codec("identity" if spec != "identity" else "fp16")
    with pytest.raises(WireFormatError, match="codec id"):
        other.decode(payload, (50, 40))


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if s not in ("identity", "fp16", "bf16")])
def test_checksummed_but_inconsistent_payloads_are_rejected(spec):
    """An attacker can compute a valid crc32: length and bound checks must not rely on it."""
    codec = get_codec(spec)
    x = torch.randn(50, 40)
    frame = unpack(codec.encode(x, {}))
    params, body = bytes(frame.params), bytes(frame.body)
    variants = [
        (params[:-1], body),  # short params
        (params, body[:-1]),  # short body
        (params, body + b"\0\0\0\0"),  # long body
    ]
    if spec.startswith(("topk", "dcttopk")):
        k = struct.unpack_from("<Q", params)[0]
        variants.append((struct.pack("<Q", 10**9) + params[8:], body))  # k larger than the tensor
        idx = bytearray(body)
        idx[0:2], idx[2:4] = idx[2:4], idx[0:2]  # indices out of order
        variants.append((params, bytes(idx)))
        big = bytearray(body)
        width = params[8]
        big[(k - 1) * width : k * width] = (50 * 40).to_bytes(width, "little")  # index past the end
        variants.append((params, bytes(big)))
    if spec.startswith("dcttopk"):  # 50 x 40 tiles into whole blocks (50 x 40 or 10 x 10): no padding
        variants.append((params[:-4] + struct.pack("<I", 0), body))  # chunk 0
        variants.append((params[:-4] + struct.pack("<I", 10**6), body))  # chunk past the limit
    if spec.startswith("int"):
        variants.append((params[:4] + bytes([3]) + params[5:], body))  # wrong bit width
    if spec.startswith("powersgd"):
        variants.append((params[:1] + struct.pack("<I", 999) + params[5:], body))  # rank > matrix
    for p, b in variants:
        with pytest.raises(WireFormatError):
            codec.decode(pack(codec.codec_id, torch.float32, (50, 40), p, b), (50, 40))


def test_non_finite_payloads_fail_validation():
    x = torch.randn(300)
    x[5] = float("nan")
    for spec in ["identity", "bf16", "int8", "int4:scale=fp16", "topk:fraction=0.5"]:
        codec = get_codec(spec)
        with pytest.raises(WireFormatError, match="non-finite"):
            codec.validate(codec.encode(x), (300,))
        codec.validate(codec.encode(torch.randn(300)), (300,))
    with pytest.raises(OverflowError, match="fp16 range"):
        get_codec("fp16").encode(torch.tensor([1e5]))


@pytest.mark.parametrize(
    "spec, log_mag",
    [  # fp16 values hold up to 65504: those specs only at magnitudes they can carry
        (spec, mag)
        for spec in ALL_SPECS
        for mag in (-6, 0, 6, 30)
        if mag <= 4 or "fp16" not in spec or "scale=fp16" in spec
    ],
)
def test_validate_bounds_the_norm_of_what_a_payload_decodes_to(spec, log_mag):
    """The bound validate returns is at least the decoded tensor's L2 norm (so at least every decoded
    value's magnitude), for every codec, over magnitudes from 1e-6 to 1e30; within 10x of it while
    the norm's squares fit fp32 (at 1e30 it may be +inf: finite, too large for the bound)."""
    codec = get_codec(spec)
    x = torch.randn(60, 50) * 10.0**log_mag
    payload = codec.encode(x)
    bound = codec.validate(payload, (60, 50))
    decoded = codec.decode(payload, (60, 50)).double()
    norm = float(decoded.norm())
    assert norm <= bound * (1 + 1e-5), (norm, bound)
    assert float(decoded.abs().max()) <= bound * (1 + 1e-5)
    if log_mag <= 6:
        assert bound <= 10 * max(norm, float(x.double().norm()))


@pytest.mark.parametrize("spec", ["identity", "bf16", "int8", "int4:scale=fp16", "topk:fraction=0.5"])
def test_finite_values_too_large_for_the_bound_are_not_called_non_finite(spec):
    """3e38 in every element is finite: validate does not refuse it as NaN/Inf; its bound is +inf or
    above 1e38 (the caller refuses it as too large)."""
    codec = get_codec(spec)
    x = torch.full((40, 30), 3e38)
    bound = codec.validate(codec.encode(x), (40, 30))
    assert bound > 1e38


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_fast_path_is_exact(dtype):
    """The one-pass sum check agrees with isfinite, including sums that overflow on finite data."""
    from atoll.compression.base import all_finite

    big = torch.finfo(dtype).max
    cases = {
        "normal": torch.randn(3000),
        "empty": torch.zeros(0),
        "overflowing sum": torch.full((3000,), big),  # finite elements, infinite sum
        "cancelling infinities": torch.tensor([float("inf"), float("-inf")] + [1.0] * 10),
        "nan": torch.tensor([1.0] * 2000 + [float("nan")]),
        "inf in a later chunk": torch.cat([torch.full(((1 << 20) + 5,), big), torch.tensor([float("inf")])]),
    }
    for name, t in cases.items():
        t = t.to(dtype)
        assert all_finite(t) == bool(torch.isfinite(t).all()), name


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3000),
    log_mag=st.floats(-8, 4),
    block=st.sampled_from([8, 32, 256, 1024]),
    bits=st.sampled_from(["int8", "int4", "int2"]),
    scale=st.sampled_from(["fp32", "fp16"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_blockwise_bound(n, log_mag, block, bits, scale, seed):
    spec = f"{bits}:block={block},scale={scale}"
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 10**log_mag
    x = x.float()
    codec = get_codec(spec)
    y = codec.decode(codec.encode(x), (n,))
    assert bool(((y - x).abs() <= blockwise_bound(x, codec)).all())


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 150),
    cols=st.integers(1, 150),
    log_mag=st.floats(-8, 4),
    fraction=st.sampled_from([0.01, 0.1, 1.0]),
    chunk=st.sampled_from([8, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_dcttopk_never_adds_energy_and_is_near_lossless_when_everything_fits(
    rows, cols, log_mag, fraction, chunk, seed
):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 10**log_mag
    x = x.float()
    codec = get_codec(f"dcttopk:fraction={fraction},chunk={chunk}")
    y = codec.decode(codec.encode(x), (rows, cols))
    err, norm = float((y - x).double().norm()), float(x.double().norm())
    assert err <= 1.01 * norm  # an orthonormal basis: dropping coefficients only removes energy
    _, _, _, _, padded_rows, padded_cols = dct_mod.layout((rows, cols), chunk)
    if fraction == 1.0 and (padded_rows, padded_cols) == (rows, cols):
        assert err <= 0.02 * norm  # every coefficient kept: only the int8 rounding is left


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400), spec=st.sampled_from(ALL_SPECS))
def test_property_random_bytes_only_raise_wire_format_error(data, spec):
    codec = get_codec(spec)
    with contextlib.suppress(WireFormatError):
        codec.decode(data, (10, 10))


def test_codec_specs():
    assert available_codecs() == sorted(
        ["identity", "fp16", "bf16", "int8", "int4", "int2", "topk", "dcttopk", "powersgd", "sparse"]
    )
    assert get_codec("sparse").spec == "sparse:density=0.0078125,bits=2,chunk=4096"
    assert get_codec("dcttopk:fraction=0.01").spec == "dcttopk:fraction=0.01,values=int8,chunk=64"
    assert get_codec("int8:block=128,scale=fp16").spec == "int8:block=128,scale=fp16"
    assert get_codec("topk:fraction=0.01").spec == "topk:fraction=0.01,values=int8"
    for bad, msg in [
        ("lz4", "unknown codec 'lz4'"),
        ("int8:block=7", "multiple of 8"),
        ("topk:fraction=2", "fraction"),
        ("int8:rank=3", r"bad parameter 'rank=3' \(it takes block, scale\)"),
        ("fp16:block=8", r"\(it takes none\)"),
        ("int8:block=x", "not a int"),
        ("topk:foo=1", r"bad parameter 'foo=1' \(it takes fraction, values\)"),
        ("dcttopk:chunk=0", "chunk"),
        ("dcttopk:chunk=1000", "chunk"),
        ("sparse:density=0", "density"),
        ("sparse:bits=9", "bits"),
        ("sparse:chunk=4", "chunk"),
    ]:
        with pytest.raises(ValueError, match=msg):
            get_codec(bad)


def test_each_codec_declares_the_parameters_its_constructor_takes():
    import inspect

    from atoll.compression import _REGISTRY

    for name, cls in _REGISTRY.items():
        signature = inspect.signature(cls.__init__).parameters
        taken = {k: p for k, p in signature.items() if k != "self" and p.kind is p.POSITIONAL_OR_KEYWORD}
        assert set(cls.params) == set(taken), name
        for key, kind in cls.params.items():
            default = taken[key].default
            assert isinstance(default, kind), (name, key)  # its spec string round-trips
            assert get_codec(f"{name}:{key}={default}").spec == get_codec(name).spec


def test_error_feedback_decay_sends_the_decayed_residual_exactly():
    """C(x + β·e) is sent and e <- x + β·e - D(C(x + β·e)), checked bitwise against a hand replay."""
    gen = torch.Generator().manual_seed(3)
    plain = get_codec("topk:fraction=0.05")
    ef, state = ErrorFeedback(get_codec("topk:fraction=0.05"), decay=0.5), {}
    residual = torch.zeros(500)
    for _ in range(4):
        x = torch.randn(500, generator=gen)
        want_in = x + 0.5 * residual
        want = plain.encode(want_in)
        assert bytes(ef.encode(x, state)) == bytes(want)
        residual = want_in - plain.decode(want, (500,))
        torch.testing.assert_close(state["residual"], residual, rtol=0, atol=0)
    assert float(residual.abs().max()) > 0  # the replay really carried something
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="decay"):
            ErrorFeedback(plain, decay=bad)


@pytest.mark.parametrize("spec", ["topk:fraction=0.01", "dcttopk:fraction=0.01", "int2", "powersgd:rank=1"])
def test_error_feedback_tracks_the_sum_of_updates(spec):
    """sum(decoded) + residual == sum(true) at every round, and the residual stays bounded."""
    gen = torch.Generator().manual_seed(0)
    shape = (40, 50)
    drift = torch.randn(shape, generator=gen)
    ef, state = ErrorFeedback(get_codec(spec)), {}
    plain = get_codec(spec)
    true_sum = torch.zeros(shape, dtype=torch.float64)
    sent_sum = torch.zeros(shape, dtype=torch.float64)
    plain_sum = torch.zeros(shape, dtype=torch.float64)
    residual_norms = []
    rounds = 300
    for _ in range(rounds):
        u = drift + torch.randn(shape, generator=gen)
        true_sum += u.double()
        sent_sum += ef.decode(ef.encode(u, state), shape).double()
        plain_sum += plain.decode(plain.encode(u, {}), shape).double()
        residual_norms.append(float(state["residual"].norm()))
        torch.testing.assert_close(sent_sum + state["residual"].double(), true_sum, rtol=0, atol=1e-3)
    # Bounded: no growth between the middle and the end of the run.
    assert max(residual_norms[-50:]) <= 1.5 * max(residual_norms[100:150])
    ef_err = float((true_sum - sent_sum).norm() / true_sum.norm())
    plain_err = float((true_sum - plain_sum).norm() / true_sum.norm())
    assert ef_err < 0.2 and ef_err < plain_err / 4, (ef_err, plain_err)
    assert math.isfinite(ef_err)


@pytest.mark.parametrize("spec", ["identity", "fp16", "bf16", "int8", "int4", "int2", "int8:block=64,scale=fp16"])
def test_a_codec_that_adds_exactly_adds_bit_for_bit_what_decode_then_add_gives(spec):
    """Islands apply a lossy update with ``decode_add_`` when the codec says it adds exactly (no
    temporary the size of the tensor); their θ must stay bitwise the coordinator's θ + decode(u)."""
    codec = get_codec(spec)
    assert codec.adds_exactly
    gen = torch.Generator().manual_seed(7)
    u = torch.randn(1000, 37, generator=gen) * 1e-2  # 37000 values: a ragged last block
    theta = torch.randn(1000, 37, generator=gen)
    payload = codec.encode(u)
    want = codec.decode(payload, (1000, 37)) + theta  # the coordinator: decode, then add θ
    got = codec.decode_add_(payload, theta.clone())
    assert torch.equal(got, want)


@pytest.mark.parametrize("numel", [(1 << 20) + 3 * 256, 37_000])
@pytest.mark.parametrize("alpha", [1.0, 3.7])
def test_int8_decode_is_code_times_scale_and_a_weighted_add_rounds_the_product_first(numel, alpha):
    """The int8 decode's bits, from the payload's own bytes in NumPy float32: code x block scale, and a
    weighted decode-and-add is ``out + (decoded * alpha)`` with the product rounded on its own (two
    chunks of whole blocks, and a ragged last block)."""
    codec = get_codec("int8")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(numel, generator=gen) * 1e-2
    x[:300] = 0.0  # zero codes, including a whole zero block (scale 0)
    payload = codec.encode(x)
    body = np.frombuffer(codec.frame(payload, (numel,)).body, dtype=np.uint8)
    nblocks = -(-numel // 256)
    scales = body[: 4 * nblocks].view(np.float32)
    codes = body[4 * nblocks :].view(np.int8)
    want = codes.astype(np.float32) * np.repeat(scales, 256)[:numel]
    assert np.array_equal(codec.decode(payload, (numel,)).numpy().view(np.int32), want.view(np.int32))
    out = torch.randn(numel, generator=gen)
    expect = out.numpy() + want * np.float32(alpha)
    got = codec.decode_add_(payload, out.clone(), alpha=alpha)
    assert np.array_equal(got.numpy().view(np.int32), expect.view(np.int32))


@pytest.mark.parametrize("spec", ["identity", "fp16", "bf16", "int8", "int4"])
@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_writing_a_weighted_payload_is_adding_it_into_zeros_bit_for_bit(spec, alpha):
    """The first contribution to a tensor of the coordinator's sum is written, not added into a zeroed
    tensor (one pass fewer); the bits are the same, a stored -0.0 included (0 + -0.0 is +0.0)."""
    codec = get_codec(spec)
    assert codec.writes_weighted
    x = torch.randn(70_001, generator=torch.Generator().manual_seed(4))
    x[::7] = -0.0
    payload = codec.encode(x)
    added = torch.zeros_like(x)
    codec.decode_add_(payload, added, alpha=alpha)
    written = torch.full_like(x, float("nan"))  # whatever it held before
    codec.write_weighted_(payload, written, alpha=alpha)
    assert torch.equal(written.view(torch.int32), added.view(torch.int32))
    assert not bool((torch.signbit(written) & (written == 0)).any())
