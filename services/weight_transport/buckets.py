"""How a version is cut for the weight group (``collective.py``): buckets and the pieces they travel in.

    bucket_layout(specs, b)   tensors packed at 64-byte offsets into buckets of at most ``b`` bytes; a tensor
                              larger than that is a bucket of its own
    pieces(n, b)              the (start, stop) byte ranges one bucket of ``n`` bytes travels in: at most ``b``
                              each, so a bucket larger than the bucket size (one big weight) needs no buffer
                              of its size on any GPU it passes through

Publisher and receivers derive the same layout and pieces from the version's header.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.weight_transport.tensors import TensorSpec

ALIGN = 64  # bytes: every tensor starts at a multiple of this in its bucket (any dtype's view is aligned)
DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    items: tuple[tuple[int, int], ...]  # (index into the version's tensors, byte offset in the bucket)


def bucket_layout(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    buckets: list[Bucket] = []
    items: list[tuple[int, int]] = []
    size = 0
    for i, spec in enumerate(specs):
        offset = aligned(size)
        if items and offset + spec.nbytes > bucket_bytes:
            buckets.append(Bucket(size, tuple(items)))
            items, offset = [], 0
        items.append((i, offset))
        size = offset + spec.nbytes
    if items:
        buckets.append(Bucket(size, tuple(items)))
    return buckets


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def pieces(nbytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """One empty range for an empty bucket, so every bucket is at least one broadcast."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    return [(start, min(start + bucket_bytes, nbytes)) for start in range(0, nbytes, bucket_bytes)] or [
        (0, 0)
    ]


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass
class TransferStats:
    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9
