"""How a version reaches vLLM workers in other processes: through one safetensors file they load from.

Where the model is not in the sampler's process (an engine core or tensor-parallel workers in other
processes), a broker-path version is written to ``$VCPO_WEIGHT_STAGING`` (default ``/dev/shm``) and each
worker's ``reload_weights`` reads it: vLLM's message queue would otherwise pickle the whole version to every
worker. Writing billions of parameters takes seconds, so :meth:`GenerationEngine.prepare` writes the file
*before* the sampler pauses the engine, and ``apply`` then only reloads from it (a load not prepared writes
it itself). The sampler's loop alone writes, reads and removes the file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.sampler.engine import _Staged

log = logging.getLogger(__name__)

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
    _reload: Callable[..., None]  # a load into the workers (``VllmEngine._reload``)

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
        """Remove the staging file and its directory (the next engine here sweeps a killed process's); never an
        error of its own in place of the load's."""
        self._file = None
        with contextlib.suppress(OSError):
            (self._staging_dir() / "model.safetensors").unlink(missing_ok=True)
            self._staging_dir().rmdir()

    def _prepare(self, staged: _Staged) -> None:
        if self._model_here or (self._file is not None and self._file() is staged):
            return
        t0 = time.monotonic()
        self._write(staged.tensors.items())
        self._file = weakref.ref(staged)
        log.info("version %d written for the workers in %.1fs", staged.version, time.monotonic() - t0)

    def _load_staged(self, staged: _Staged) -> None:
        if self._model_here or self._file is None or self._file() is not staged:
            self._load(staged.tensors.items())
        else:
            self._load_file()

    def _load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a version: as tensors where the model is in this process, else through the file (a failure
        while writing it leaves the engine untouched)."""
        if self._model_here:
            self._reload(weights_iterator=iter(tensors))
        else:
            self._write(tensors)
            self._load_file()

    def _load_file(self) -> None:
        try:
            self._reload(weights_path=str(self._staging_dir()))
        finally:
            self._drop_file()
