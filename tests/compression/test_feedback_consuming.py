"""ErrorFeedback.encode_consuming: the bits of encode, with the input tensor itself made the residual."""

from __future__ import annotations

import pytest
import torch

from atoll.compression import ErrorFeedback, get_codec


@pytest.mark.parametrize("spec", ["int8", "int4", "sparse", "topk:fraction=0.05"])
def test_encode_consuming_gives_encodes_bits_and_keeps_no_new_tensor(spec):
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(5000, generator=gen) for _ in range(3)]
    a, b = ErrorFeedback(get_codec(spec)), ErrorFeedback(get_codec(spec))
    sa, sb = {}, {}
    for x in inputs:  # three rounds: the residual carried from each into the next
        want = a.encode(x, sa)
        given = x.clone()
        got = b.encode_consuming(given, sb)
        assert bytes(got) == bytes(want)
        assert torch.equal(sb["residual"], sa["residual"])
        assert sb["residual"] is given  # the input became the residual: nothing the size of x allocated
    with pytest.raises(ValueError, match="contiguous float32"):
        b.encode_consuming(torch.zeros(10, dtype=torch.float64), {})
