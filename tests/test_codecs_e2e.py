"""The demo run (real processes) with compressed pseudo-gradients: loss and bytes on the wire."""

import pytest

from atoll.harness.demo import DemoArgs, run_island_group


def run(tmp_path, codec: str, error_feedback: bool = False):
    args = DemoArgs(rounds=6, sync_every=30, codec=codec, error_feedback=error_feedback)
    events, codes = run_island_group(args, tmp_path / codec.replace(":", "_"), progress=False)
    assert codes == [0, 0]
    rounds = [e for e in events if e["event"] == "round"]
    final = [e["eval_loss"] for e in rounds if e["round"] == args.rounds - 1]
    assert len(final) == 2 and final[0] == final[1]  # identical θ on both islands -> identical eval
    sent = sum(e["bytes_sent"] for e in rounds)  # measured by the client: header + payload bytes
    return final[0], sent


@pytest.fixture(scope="module")
def identity(tmp_path_factory):
    return run(tmp_path_factory.mktemp("identity"), "identity")


def test_int8_matches_identity_with_4x_fewer_bytes(tmp_path, identity):
    loss_id, bytes_id = identity
    loss_q, bytes_q = run(tmp_path, "int8")
    assert abs(loss_q - loss_id) / loss_id < 0.01, (loss_q, loss_id)
    assert bytes_id / bytes_q > 3.8, (bytes_id, bytes_q)


def test_topk_with_error_feedback_cuts_bytes_30x(tmp_path, identity):
    loss_id, bytes_id = identity
    loss_k, bytes_k = run(tmp_path, "topk:fraction=0.01", error_feedback=True)
    assert bytes_id / bytes_k >= 30, (bytes_id, bytes_k)
    # Measured here: ~11% above identity after 6 rounds (the 5% target is not met; see
    # benchmarks/RESULTS.md). This pins the current quality so a regression shows.
    assert loss_k < 1.15 * loss_id, (loss_k, loss_id)
    assert loss_k < 0.8 * 4.06  # still clearly learning from the 4.06 start
