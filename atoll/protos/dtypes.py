"""The wire DType enum and torch dtypes, both ways."""

import torch

from atoll.protos import coordinator_pb2 as pb

PB_FROM_TORCH = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float64: pb.DTYPE_FLOAT64,
}
TORCH_FROM_PB = {v: k for k, v in PB_FROM_TORCH.items()}
