"""atoll.files.write_atomic: every byte lands, at any size around the O_DIRECT block and bounce buffer,
and a write that fails leaves the old file whole and nothing beside it."""

import os

import numpy as np
import pytest

from atoll.files import BOUNCE_BYTES, DIRECT_BLOCK, write_atomic


@pytest.mark.parametrize("durable", [True, False])
def test_every_byte_lands_at_sizes_around_the_block_and_the_bounce_buffer(tmp_path, durable):
    rng = np.random.default_rng(0)
    for sizes in ([0], [1], [DIRECT_BLOCK - 1], [DIRECT_BLOCK], [DIRECT_BLOCK + 1, 3], [BOUNCE_BYTES + 5, 7, 0]):
        parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
        path = tmp_path / f"f-{'-'.join(map(str, sizes))}"
        write_atomic(path, [memoryview(p) for p in parts], durable)
        assert path.read_bytes() == b"".join(p.tobytes() for p in parts)
    assert sorted(os.listdir(tmp_path)) == sorted(p for p in os.listdir(tmp_path) if not p.startswith("."))


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "membership.json"
    write_atomic(path, [b"old"])

    class Unreadable:
        """Not a buffer: the write fails after the temporary file was opened."""

    with pytest.raises(TypeError):
        write_atomic(path, [b"new", Unreadable()])
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["membership.json"]
