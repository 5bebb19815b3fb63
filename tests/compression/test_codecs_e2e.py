"""The demo run (real processes) with compressed pseudo-gradients: loss and bytes on the wire."""

import pytest

from atoll.harness.demo import DemoArgs, run_island_group


def run(tmp_path, codec: str, error_feedback: bool = False, *, rounds: int = 6, decay: float = 1.0, trace=None, **kw):
    options = {k: v for k, v in kw.items() if k != "steady"}
    args = DemoArgs(
        rounds=rounds, sync_every=30, codec=codec, error_feedback=error_feedback, error_feedback_decay=decay, **options
    )
    events, codes = run_island_group(args, tmp_path / f"{codec.replace(':', '_')}-{decay:g}", progress=False)
    assert codes == [0, 0]
    rounds = [e for e in events if e["event"] == "round"]
    final = [e["eval_loss"] for e in rounds if e["round"] == args.rounds - 1]
    assert len(final) == 2 and final[0] == final[1]  # identical θ on both islands -> identical eval
    sent = sum(e["bytes_sent"] for e in rounds)  # measured by the client: header + payload bytes
    if kw.get("steady") is not None:  # each island's (bytes sent, bytes received) a round after θ_0's
        kw["steady"].extend((e["bytes_sent"], e["bytes_received"]) for e in rounds if e["round"] > 0)
    if trace is not None:
        trace.extend(e["eval_loss"] for e in rounds if e["island"] == rounds[0]["island"])
    return final[0], sent


@pytest.fixture(scope="module")
def identity(tmp_path_factory):
    return run(tmp_path_factory.mktemp("identity"), "identity")


def test_int8_matches_identity_with_4x_fewer_bytes(tmp_path, identity):
    loss_id, bytes_id = identity
    loss_q, bytes_q = run(tmp_path, "int8")
    assert abs(loss_q - loss_id) / loss_id < 0.01, (loss_q, loss_id)
    assert bytes_id / bytes_q > 3.8, (bytes_id, bytes_q)


def test_topk_1pct_with_error_feedback_within_5pct_of_identity_on_30x_fewer_bytes(tmp_path, identity):
    """Top-k 1% of the block-DCT coefficients, EF with β = 0.3. Measured here (demo defaults, 6
    rounds): 2.7175 vs identity 2.6220 (+3.6%), 67x fewer bytes pushed."""
    loss_id, bytes_id = identity
    loss_k, bytes_k = run(tmp_path, "dcttopk:fraction=0.01", error_feedback=True, decay=0.3)
    assert bytes_id / bytes_k >= 30, (bytes_id, bytes_k)
    assert loss_k < 1.05 * loss_id, (loss_k, loss_id)


def test_raw_topk_1pct_with_error_feedback_learns_on_30x_fewer_bytes(tmp_path, identity):
    """Top-k of the raw elements keeps ~6% of a round's ||Δ||² where the DCT basis keeps ~16%
    (benchmarks/topk_basis.py): measured 2.9103 (+11%) after 6 rounds, pinned so a regression shows."""
    loss_id, bytes_id = identity
    loss_k, bytes_k = run(tmp_path, "topk:fraction=0.01", error_feedback=True)
    assert bytes_id / bytes_k >= 30, (bytes_id, bytes_k)
    assert loss_k < 1.15 * loss_id, (loss_k, loss_id)
    assert loss_k < 0.8 * 4.06  # still clearly learning from the 4.06 start


def test_sparse_both_ways_keeps_every_islands_theta_identical_on_100x_fewer_bytes(tmp_path, identity):
    """``sparse`` up and down (the coordinator re-encodes its update with its own error feedback): the
    islands' θ bitwise the same (their evals equal), learning, on >=100x fewer bytes than fp32 each
    way, counted by the islands (measured: 105.6x up, 115.6x down). The demo's model is small (0.11M
    values, most tensors under a chunk of 4096), so headers weigh more than at 3M
    (``benchmarks/codec_quality.py``: >=300x up there)."""
    loss_id, _ = identity
    steady: list[tuple[int, int]] = []
    loss_s, _ = run(tmp_path, "sparse", error_feedback=True, downlink_codec="sparse", steady=steady)
    fp32 = 4 * 112_512  # the demo's tiny GPT
    assert min(fp32 / up for up, _ in steady) >= 100, steady
    assert min(fp32 / down for _, down in steady) >= 100, steady
    assert loss_s < 0.85 * 4.06, (loss_s, loss_id)  # learning from the 4.06 start


@pytest.mark.slow
def test_decayed_error_feedback_keeps_a_long_topk_run_converging(tmp_path):
    """20 rounds of top-k 1% at outer lr 0.7 / Nesterov 0.9: classic EF (β=1) lets residuals grow
    ~one Δ per round and the global θ degrades after round 5; β=0.5 keeps improving. Measured here:
    3.147 vs 2.627 (identity at 20 rounds: 2.495), per-round evals in benchmarks/RESULTS.md."""
    classic, decayed = [], []
    outer = {"outer_lr": 0.7, "outer_momentum": 0.9}
    loss_1, _ = run(tmp_path, "topk:fraction=0.01", True, rounds=20, decay=1.0, trace=classic, **outer)
    loss_half, _ = run(tmp_path, "topk:fraction=0.01", True, rounds=20, decay=0.5, trace=decayed, **outer)
    assert len(classic) == len(decayed) == 20
    assert loss_half < 0.9 * loss_1, (loss_half, loss_1)
    assert decayed[-1] < decayed[9] < decayed[4], decayed  # still falling in the second half
    assert max(classic[10:]) > 1.05 * classic[5], classic  # classic EF got clearly worse after round 5 (3.46 vs 2.95)
