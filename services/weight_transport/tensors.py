"""Tensors as bytes: dtypes, zero-copy views, checksums, manifests and the safetensors file layout.

Shared by the broker's stores, its gRPC servicer and the client transports, so every path agrees on
what a version's bytes are. A version is an ordered list of tensors in Hugging Face naming; each tensor's
checksum is ``xxh3_128:<hex>`` of its raw little-endian bytes, and the version checksum is the same hash
over the lines ``name\\0tensor_checksum\\n`` in transfer order. On disk a version is a standard
``model.safetensors`` (8-byte header length, JSON header with offsets, raw data).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import xxhash

from vcpo.v1 import weights_pb2

# our dtype name -> (torch dtype, safetensors code)
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "F32"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
    "float64": (torch.float64, "F64"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"),
}
_BY_TORCH = {t: name for name, (t, _) in DTYPES.items()}
Buffer = bytes | memoryview  # bytes on their way: a tensor's, a piece of them, a serialized message


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {dtype}; supported: {sorted(DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name][0]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's identity without its data: what a publisher knows before gathering it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch_dtype(self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def next_checked(
    i: int, specs: Sequence[TensorSpec], source: Iterator[tuple[str, torch.Tensor]]
) -> torch.Tensor:
    """The source's next tensor, which must be the header's tensor ``i`` (name, dtype, shape)."""
    spec = specs[i]
    item = next(source, None)
    if item is None:
        raise ValueError(f"the source ended at tensor {i} ({spec.name!r}) of {len(specs)}")
    got = TensorSpec.of(*item)
    if got != spec:
        raise ValueError(f"tensor {i} is {got}, the version's header said {spec}")
    return item[1]


def check_exhausted(source: Iterator[tuple[str, torch.Tensor]]) -> None:
    leftover = next(source, None)
    if leftover is not None:
        raise ValueError(f"the source yielded more tensors than the header named, e.g. {leftover[0]!r}")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw bytes as a zero-copy view (one copy only if it is not contiguous on the CPU)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


class Hasher:
    """Incremental checksum of one tensor's bytes."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return f"xxh3_128:{self._h.hexdigest()}"


def version_checksum(tensors: Sequence[weights_pb2.TensorMeta] | Sequence[tuple[str, str]]) -> str:
    """The version checksum over ``(name, tensor checksum)`` pairs in transfer order."""
    h = Hasher()
    for t in tensors:
        name, digest = (t.name, t.checksum) if isinstance(t, weights_pb2.TensorMeta) else t
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()


def manifest_of(
    specs: Sequence[TensorSpec], policy_version: int, run_id: str = ""
) -> weights_pb2.VersionManifest:
    """A publish manifest (no checksums yet; the broker checks it, ``store._validate``)."""
    return weights_pb2.VersionManifest(
        policy_version=policy_version,
        run_id=run_id,
        tensors=[
            weights_pb2.TensorMeta(name=s.name, dtype=s.dtype, shape=list(s.shape), nbytes=s.nbytes)
            for s in specs
        ],
        total_bytes=sum(s.nbytes for s in specs),
    )


def safetensors_header(manifest: weights_pb2.VersionManifest) -> tuple[bytes, list[int]]:
    """The safetensors prefix (length + JSON header, padded to 8 bytes) and each tensor's data offset in the file."""
    header: dict[str, object] = {
        "__metadata__": {"format": "pt", "policy_version": str(manifest.policy_version)}
    }
    offset = 0
    for t in manifest.tensors:
        header[t.name] = {
            "dtype": DTYPES[t.dtype][1],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    starts, pos = [], len(prefix)
    for t in manifest.tensors:
        starts.append(pos)
        pos += t.nbytes
    return prefix, starts
