"""How a version reaches vLLM workers in other processes: through one safetensors file they load from.

Where the model is not in the sampler's process (an engine core in another process, or worker processes for
tensor parallelism), a broker-path version is written to ``$VCPO_WEIGHT_STAGING`` (default ``/dev/shm``) and
each worker's ``reload_weights`` reads it: vLLM's message queue would otherwise pickle the whole version to
every worker. Writing billions of parameters takes seconds, so :meth:`GenerationEngine.prepare` writes the
file *before* the sampler pauses the engine (the engine core goes on generating meanwhile), and ``apply``
then only reloads from it; a load that was not prepared (a restore after a failed load, or a caller that
skips ``prepare``) writes the file itself. The sampler's loop alone writes, reads and removes the file: the
weight-sync thread only stages tensors in memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from services.sampler.engine import _Staged

log = logging.getLogger(__name__)

# where a multi-process engine's workers read each broker-path version from (under $VCPO_WEIGHT_STAGING)
STAGING_DIR = "vcpo-weights-{pid}"


class LoadNotStarted(OSError):
    """A load that failed before it touched the engine (writing the file its workers read: a full /dev/shm).
    The engine serves the version it served; nothing is loaded back."""


class StagingFile:
    """The staging-file side of :class:`~services.sampler.engine.VllmEngine` (it takes it in)."""

    _model_here: bool  # the model runs in this process: versions go to it as tensors, no file
    _staging_root: Path
    # the staged version the file holds now, if any: a weak reference, so that a version a newer one replaced
    # before it was applied does not keep its tensors in memory
    _file: weakref.ref[_Staged] | None

    def _reload(self, **source: Any) -> None:
        raise NotImplementedError

    def _staging_dir(self) -> Path:
        return self._staging_root / STAGING_DIR.format(pid=os.getpid())

    def _write(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write a version into the staging file the workers load from; LoadNotStarted if that fails."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        directory = self._staging_dir()
        self._file = None  # whatever the file held, it is being overwritten
        try:
            directory.mkdir(parents=True, exist_ok=True)
            save_file({name: t.contiguous() for name, t in tensors}, str(directory / "model.safetensors"))
        except (OSError, SafetensorError) as exc:
            self._drop_file()
            # nothing was loaded, so nothing is restored (after a version from the weight group, whose tensors
            # this process never held, a restore would load the initial weights)
            raise LoadNotStarted(
                f"could not write the file the engine's workers load from in {self._staging_root} ({exc}); "
                "give /dev/shm room for one more version (rayCluster.shmSize) or set VCPO_WEIGHT_STAGING"
            ) from exc

    def _drop_file(self) -> None:
        """Remove the staging file and its directory (a process killed first leaves both: the next engine to
        start here sweeps them); never an error of its own in place of the load's."""
        self._file = None
        directory = self._staging_dir()
        with contextlib.suppress(OSError):
            (directory / "model.safetensors").unlink(missing_ok=True)
            directory.rmdir()

    def _holds(self, staged: _Staged) -> bool:
        return self._file is not None and self._file() is staged

    def _prepare(self, staged: _Staged) -> None:
        # the file write (seconds for billions of parameters) while the engine core goes on generating; only
        # the reload from it happens while paused. The main loop alone writes, reads and removes the file.
        if self._model_here or self._holds(staged):
            return
        t0 = time.monotonic()
        self._write(staged.tensors.items())
        self._file = weakref.ref(staged)
        log.info(
            "version %d written for the engine's workers in %.1fs", staged.version, time.monotonic() - t0
        )

    def _load_staged(self, staged: _Staged) -> None:
        if self._model_here or not self._holds(staged):
            self._load(staged.tensors.items())
            return
        try:
            self._reload(weights_path=str(self._staging_dir()))
        finally:
            self._drop_file()

    def _load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._model_here:  # the model is in this process: hand it the tensors
            self._reload(weights_iterator=iter(tensors))
            return
        # worker processes read the version from a local safetensors file (shared memory by default); a
        # failure while writing it has touched nothing in the engine
        self._write(tensors)
        try:
            self._reload(weights_path=str(self._staging_dir()))
        finally:
            self._drop_file()
