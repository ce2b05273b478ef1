"""Learner checkpoints that a kill at any moment leaves loadable: ``latest`` names only a complete tag.

    every rank   DeepSpeed writes its shards into <dir>/incomplete-stepNNNNNNNNN/ (save_latest=False),
                 each file fsynced as soon as it is written
    all ranks    the files each wrote, with their sizes, gathered: a barrier that follows every shard on disk
    rank 0       checks it sees every rank's files at their sizes (a checkpoint_dir not shared fails here)
                 incomplete-stepN ─rename─► stepN, fsync <dir>
                 latest.tmp (fsync) ─os.replace─► latest, fsync <dir>
                 then removes tags past ``keep``, leftovers of interrupted saves, tags newer than the commit
    all ranks    rank 0's outcome, broadcast: an error there is raised on every rank, none left waiting

Why not DeepSpeed's own ``latest``: DeepSpeed 0.19.8 (``DeepSpeedEngine.save_checkpoint``) has rank 0 write
``latest`` after its own shards and before the final barrier. The one collective in between (ZeRO-3's
``checkpoint_event_epilogue``, a gather of the persistent weights) returns on the host once queued under
NCCL, so rank 0 names the tag while other ranks may still be writing; a rank killed then (the launcher's
stop wait running out on a 7B checkpoint of ~91 GB) leaves ``latest`` naming a tag whose other shards are
missing or cut short, and the next start fails in ``load_checkpoint``. Its default checkpoint engine
(``torch.save``) does not fsync either, so even a complete tag may not survive the node. Here a ``stepN``
directory exists only once complete (a rename, atomic on POSIX file systems and NFS), so the launcher, the
export and the pruning can trust a tag's name, and ``latest`` moves to it only after that.

Loading (:func:`resolve`): the tag ``latest`` names, when its directory exists; else the newest ``stepN``
directory (every one is complete: an interrupted commit, between the rename and ``latest``); none: a fresh
start. ``latest`` naming a directory that is gone while no ``stepN`` is left is an error, never a fresh start
that would publish version 1 again. Saving the step ``latest`` names again (the service never does: it
checkpoints only past the step it resumed from) moves the committed copy aside for the rename, so a kill in
between resumes from the newest older tag.

:data:`BYTES_PER_PARAMETER` is what a ZeRO-3 checkpoint holds per parameter (the fp32 master weights and
AdamW's two fp32 moments, in the ``*_optim_states.pt`` files; the ``*_model_states.pt`` files hold only
placeholders of the partitioned weights): the launcher sizes its stop wait by it
(deploy/launcher_stopping.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.learner.config import LoraConfig

log = logging.getLogger(__name__)

LATEST = "latest"
STAGING = "incomplete-"  # prefix of a tag being written; never a `step*` name, so globs of tags skip it
REPLACED = "replaced-"  # prefix of a committed tag moved aside while the same step is saved again
_TAG = re.compile(r"step(\d+)")

# fp32 master weights + AdamW's exp_avg and exp_avg_sq, each 4 B, partitioned over the ranks
BYTES_PER_PARAMETER = 12


def tag_name(step: int) -> str:
    return f"step{step:09d}"


def tag_step(name: str) -> int | None:
    """The step of a tag directory's name, None when it is not one (a staging or a moved-aside directory)."""
    found = _TAG.fullmatch(name)
    return int(found.group(1)) if found else None


def tags(directory: Path) -> list[str]:
    """The complete tags in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = [(s, p.name) for p in directory.iterdir() if p.is_dir() and (s := tag_step(p.name)) is not None]
    return [name for _, name in sorted(found)]


@dataclass(frozen=True)
class Found:
    """What a rank finds in the checkpoint directory, without raising (the ranks compare it first)."""

    tag: str | None  # the tag to load; None: nothing to load, or a problem
    problem: str = ""  # why the directory cannot be loaded

    @property
    def present(self) -> bool:
        return self.tag is not None or bool(self.problem)

    def code(self) -> int:
        """A number the ranks compare: the same tag (or the same problem) gives the same number."""
        return zlib.crc32((self.tag or "!" + self.problem).encode())


def resolve(directory: Path) -> Found:
    """The tag a start resumes from (module docstring, "Loading")."""
    latest = directory / LATEST
    named = latest.read_text().strip() if latest.is_file() else ""
    if named and (directory / named).is_dir():
        return Found(named)
    complete = tags(directory)
    if complete:
        if named:
            log.warning("%s names %s, which is gone: resuming from %s", latest, named, complete[-1])
        return Found(complete[-1])
    if latest.is_file():
        return Found(
            None,
            f"{latest} names the checkpoint tag {named!r}, but {directory / named} does not exist and no "
            f"other step* checkpoint is in {directory}: restore it, or delete {latest} to start afresh",
        )
    return Found(None)


def committed_step(directory: Path) -> int:
    """The step of the checkpoint a start would resume from; 0 without one."""
    found = resolve(directory)
    return (tag_step(found.tag) or 0) if found.tag else 0


def agree(found: Found, directory: Path, rank: int, world_size: int, device: Any) -> None:
    """Every rank must resume from the same tag: one that did not see the checkpoint (a node without the
    shared volume) would start afresh while the others resumed, their collectives mismatched. The ranks
    compare what they found (a collective) and all raise where they differ."""
    import torch

    if world_size > 1:
        present, code = int(found.present), found.code()
        seen = torch.tensor([present, -present, code, -code], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MAX)
        if int(seen[0]) != -int(seen[1]):
            raise RuntimeError(
                f"learner rank {rank} {'sees' if present else 'does not see'} a checkpoint in {directory} "
                "and another rank does not: learner.checkpoint_dir must be one directory every rank "
                "shares (a volume every learner node mounts)"
            )
        if int(seen[2]) != -int(seen[3]):
            raise RuntimeError(
                f"learner rank {rank} would resume from {found.tag or found.problem!r} in {directory} and "
                "another rank from another checkpoint: learner.checkpoint_dir must be one directory every "
                "rank shares (a volume every learner node mounts)"
            )
    if found.problem:
        raise RuntimeError(found.problem)


def fsync_path(path: Path) -> None:
    """Flush a file, or a directory's entries (a rename, a new file), to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if not path.is_dir() or exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS):
            raise
        # some FUSE and network file systems have no fsync of a directory; their renames are synchronous
        log.debug("%s: no fsync of a directory here (%s)", path, exc)
    finally:
        os.close(fd)


def write_latest(directory: Path, tag: str) -> None:
    """``latest`` names ``tag``, atomically: a reader sees the old name or the new one, never a part."""
    tmp = directory / f"{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / LATEST)
    fsync_path(directory)


@contextlib.contextmanager
def durable_writes(checkpoint_engine: Any, written: list[tuple[str, int]]) -> Iterator[None]:
    """While open, each file DeepSpeed's checkpoint engine writes is fsynced and recorded (name, size)."""
    save = checkpoint_engine.save
    had_own = "save" in vars(checkpoint_engine)

    def fsynced(state_dict: Any, path: str) -> Any:
        out = save(state_dict, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            written.append((os.path.basename(path), os.fstat(fd).st_size))
        finally:
            os.close(fd)
        return out

    checkpoint_engine.save = fsynced
    try:
        yield
    finally:
        if had_own:
            checkpoint_engine.save = save
        else:
            del checkpoint_engine.save


def has_frozen_weights(module: Any) -> bool:
    """Whether ``module`` has weights that do not train (a LoRA run's base): the model the run starts from,
    loaded again on resume, so a checkpoint leaves them out and its load does not expect them."""
    return any(not p.requires_grad for p in module.parameters())


def save(engine: Any, directory: Path, step: int, client_state: dict[str, Any], rank: int, keep: int) -> Path:
    """Every rank's shards of ``step`` under ``directory``, then ``latest`` (module docstring); a
    collective."""
    import torch.distributed as dist

    tag = tag_name(step)
    staging = directory / f"{STAGING}{tag}"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # an earlier save of this step that was cut short
    dist.barrier()
    written: list[tuple[str, int]] = []
    with durable_writes(engine.checkpoint_engine, written):
        engine.save_checkpoint(
            str(directory),
            tag=staging.name,
            client_state=client_state,
            save_latest=False,
            exclude_frozen_parameters=has_frozen_weights(engine.module),
        )
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, written)
    outcome: list[str | None] = [None]
    if rank == 0:
        try:
            _commit(directory, tag, every, keep)
        except Exception as exc:  # every rank raises it, below
            log.exception("checkpoint %s was not committed", tag)
            outcome[0] = f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise RuntimeError(f"learner checkpoint {directory / tag} was not committed: {outcome[0]}")
    return directory / tag


def _commit(directory: Path, tag: str, every: list[list[tuple[str, int]]], keep: int) -> None:
    """Rank 0, once every rank's files are on disk: the staging directory becomes the tag, ``latest``
    names it."""
    staging = directory / f"{STAGING}{tag}"
    missing = [
        f"rank {r}'s {name} ({size} bytes)"
        for r, files in enumerate(every)
        for name, size in files
        if not (staging / name).is_file() or (staging / name).stat().st_size != size
    ]
    if missing:
        raise RuntimeError(
            f"rank 0 does not see, at the size written, {', '.join(missing)} in {staging}: "
            "learner.checkpoint_dir must be one directory every rank shares (a volume every learner node "
            "mounts)"
        )
    fsync_path(staging)
    final = directory / tag
    if final.exists():
        if resolve(directory).tag == tag:  # the same step saved again: the committed copy steps aside
            aside = directory / f"{REPLACED}{tag}"
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
        else:  # a commit cut short before `latest`, or a tag of steps the run resumed from before
            shutil.rmtree(final)
    os.rename(staging, final)
    fsync_path(directory)
    write_latest(directory, tag)
    prune(directory, tag, keep)


def prune(directory: Path, committed: str, keep: int) -> None:
    """Keep the ``keep`` newest tags up to ``committed``; remove the rest, tags past it (steps of a run that
    resumed from an earlier checkpoint, which no start will load) and leftovers of interrupted saves."""
    last = tag_step(committed)
    assert last is not None, committed
    kept = [t for t in tags(directory) if (tag_step(t) or 0) <= last][-keep:]
    for path in directory.iterdir():
        if not path.is_dir() or path.name in kept:
            continue
        if tag_step(path.name) is not None or path.name.startswith((STAGING, REPLACED)):
            shutil.rmtree(path, ignore_errors=True)


def model_parameters(model: str, lora: LoraConfig | None = None) -> int:
    """Parameters a checkpoint of a model (a hub id or a local directory) holds, counted from its config on the
    meta device: every weight, or with ``lora`` enabled the adapters alone (the frozen base is left out)."""
    from transformers import AutoConfig

    from services.learner.memory import model_shape

    return model_shape(AutoConfig.from_pretrained(model), lora).trained


def checkpoint_bytes(num_parameters: int) -> int:
    """Bytes of one ZeRO-3 checkpoint of the learner, over all its ranks (:data:`BYTES_PER_PARAMETER`)."""
    return num_parameters * BYTES_PER_PARAMETER
