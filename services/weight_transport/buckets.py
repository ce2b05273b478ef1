"""How a version is cut for the weight group (``collective.py``): buckets and the pieces they travel in.

    bucket_layout(specs, b)   tensors packed at 64-byte offsets into buckets of at most ``b`` bytes; a tensor
                              larger than that is a bucket of its own
    pieces(n, b)              the (start, stop) byte ranges one bucket of ``n`` bytes travels in: at most ``b``
                              each, so a bucket larger than the bucket size (one big weight) needs no buffer
                              of its size on any GPU it passes through

Publisher and receivers derive the same layout and pieces from the version's header.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from services.weight_transport.tensors import TensorSpec, dtype_name

ALIGN = 64  # bytes: every tensor starts at a multiple of this in its bucket (any dtype's view is aligned)
DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    items: tuple[tuple[int, int], ...]  # (index into the version's tensors, byte offset in the bucket)


def bucket_layout(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """The buckets of a version, in order: tensors packed at 64-byte offsets while they fit ``bucket_bytes``;
    a tensor larger than that is a bucket of its own (sent in :func:`pieces`)."""
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
    """``offset`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-offset // ALIGN) * ALIGN


def pieces(nbytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges a bucket of ``nbytes`` is broadcast in, in order: one per ``bucket_bytes`` (the last
    shorter); one empty range for an empty bucket, so every bucket is at least one broadcast."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    return [(start, min(start + bucket_bytes, nbytes)) for start in range(0, nbytes, bucket_bytes)] or [
        (0, 0)
    ]


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view where it is contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def next_checked(
    i: int, specs: Sequence[TensorSpec], source: Iterator[tuple[str, torch.Tensor]]
) -> torch.Tensor:
    """The source's next tensor, which must be the header's tensor ``i`` (name, dtype, shape)."""
    spec = specs[i]
    item = next(source, None)
    if item is None:
        raise ValueError(f"the source ended at tensor {i} ({spec.name!r}) of {len(specs)}")
    name, tensor = item
    got = TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape))
    if got != spec:
        raise ValueError(f"tensor {i} is {got}, the version's header said {spec}")
    return tensor


def check_exhausted(source: Iterator[tuple[str, torch.Tensor]]) -> None:
    leftover = next(source, None)
    if leftover is not None:
        raise ValueError(f"the source yielded more tensors than the header named, e.g. {leftover[0]!r}")


@dataclass
class TransferStats:
    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9
