"""One host copy of each version for the receivers on a host, however many of them there are.

A GPU worker keeps a version in host memory until every member has voted to commit it (its GPU memory holds
the KV cache, not a second copy of the model). Every tensor-parallel worker of an engine receives the whole
version, so a node of eight workers would hold eight copies: 120 GB of pinned host memory for a 7B model in
bf16, 1.1 TB for a 70B one. The receivers on one host that keep host copies (``WeightGroup.host_peers``, the
GPU workers by default) keep one between them instead:

    leader     the lowest of them: stages the version in a /dev/shm segment of its own (``shared_memory.py``;
               page-locked under CUDA, so its copies from the GPU run at full speed) and names it in the
               group's store (``host_copy/<broadcast>/<leader>``) before the buckets come; the empty name when
               it cannot reserve one, or one would leave /dev/shm no room for one more version (the file the
               engine's workers read a broker-path version from goes there: every receiver of the host then
               keeps its own copy)
    the others receive the buckets through their two device buffers and keep nothing; before they vote they
               open the leader's file, and once the vote commits they map it copy-on-write: their tensors
               are views of the leader's pages (an engine's loader that writes one copies that page only)

The leader votes only after every byte is in the segment, so a version committed on the host is whole in the
file every receiver of the host loads. After the vote the leader unlinks the name (the others hold the file open),
keeps its segment page-locked until the next version (its engine loads from it), and reserves the next one's
in the background. A receiver that cannot open the file votes the version down, as one that cannot map the
publisher's segment does.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

from services.weight_broker.buckets import Bucket, bucket_offsets
from services.weight_broker.shared_memory import SHM_DIR, SharedSegment, Staging

log = logging.getLogger(__name__)

# the broker path's file is a safetensors file: the version's bytes, a header naming each tensor, alignment
FILE_SLACK = 64 << 20


class HostCopy:
    """This receiver's part in its host's copy (a :class:`WeightGroup`'s ``host_copy``, made by the first
    version it receives and released when the group closes)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.leader = group.rank == min(group.host_peers)
        self._staging = Staging(group.cuda_index)
        self._fd: int | None = None  # the others: the leader's file, opened before the vote
        self.views: list[torch.Tensor] | None = None  # the leader: each bucket's place in this version's copy
        self.opened = False  # the others: whether they could open this version's copy

    def begin(self, layout: list[Bucket]) -> bool:
        """Whether this host keeps one copy of this version: the leader staged it (``views``), the others
        opened the leader's file (``opened``: False if they could not, and then vote the version down). False
        when the leader has no room for it: every receiver of the host keeps its own."""
        if self.leader:
            self.views = None  # the last version's pages go with their last view: room for this one's
            self.views = self._stage(layout)
            return self.views is not None
        opened = self._open(layout)
        self.opened = opened is True
        return opened is not None

    def _key(self) -> str:
        return f"host_copy/{self.group.broadcasts}/{min(self.group.host_peers)}"

    def _stage(self, layout: list[Bucket]) -> list[torch.Tensor] | None:
        """The leader: each bucket's place in a segment of the whole version, named for the others (None,
        named empty, when /dev/shm cannot hold it: then every receiver of the host keeps its own copy)."""
        offsets, total = bucket_offsets(layout)
        self._staging.release(spare=False)  # the last version's: its engine has loaded it by now
        try:
            # the spare reserved after the last version, or a new one; either way /dev/shm keeps room for one
            # more version: the file the engine's workers read a broker-path version from goes there too
            whole = self._staging.take(total, keep_free=total + FILE_SLACK)
        except OSError as exc:
            log.warning(
                "cannot stage a host copy of %d bytes in %s (%s): each receiver on this host keeps its own",
                total,
                SHM_DIR,
                exc,
            )
            self.group.set_key(self._key(), "")
            return None
        assert self._staging.current is not None
        self.group.set_key(self._key(), self._staging.current.name)
        return [whole[o : o + b.nbytes] for o, b in zip(offsets, layout, strict=True)]

    def _open(self, layout: list[Bucket]) -> bool | None:
        """The others: open the leader's segment once it names it. None when it has none (keep an own copy);
        False when it cannot be opened (vote the version down, logged); True otherwise."""
        name = self.group.wait_key(self._key())
        if not name:
            return None
        self.close_file()
        _, total = bucket_offsets(layout)
        try:
            self._fd = SharedSegment.open_file(name, total)
        except (OSError, ValueError) as exc:
            log.error("cannot open the host copy %s: %s: voting against the version", name, exc)
            return False
        return True

    def committed(self, layout: list[Bucket]) -> list[torch.Tensor]:
        """After a committed vote. The leader: unlink the segment's name and reserve the next version's; returns
        nothing (its views are its buckets). The others: the leader's segment mapped, as each bucket's view."""
        offsets, total = bucket_offsets(layout)
        if self.leader:
            current = self._staging.current
            if current is not None:
                (SHM_DIR / current.name).unlink(missing_ok=True)
            self._staging.reserve_spare(total, keep_free=total + FILE_SLACK)
            return []
        assert self._fd is not None
        fd, self._fd = self._fd, None
        try:
            segment = SharedSegment.attach_fd(fd, total)
        finally:
            os.close(fd)
        assert segment.tensor is not None
        return [segment.tensor[o : o + b.nbytes] for o, b in zip(offsets, layout, strict=True)]

    def failed(self) -> None:
        """After a version that was not committed: nothing of it is kept."""
        self.close_file()
        if self.leader:
            self._staging.release(spare=False)

    def close_file(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        """The group closed: unlink and unmap what this receiver holds (views the engine still holds keep
        their pages)."""
        self.close_file()
        self._staging.release()
