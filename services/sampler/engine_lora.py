"""Versions that are LoRA adapters (``[learner.lora] publish = "adapter"``): vLLM serves the frozen base with one
adapter slot, and each version replaces the adapter in that slot.

    prepare(v)   the version's adapter directory (adapter_model.safetensors + adapter_config.json) written in
                 $VCPO_WEIGHT_STAGING (default /dev/shm) while the engine generates
    apply(v)     vLLM's ``add_lora`` with ``load_inplace`` between two steps: the slot's adapter is replaced;
                 requests added from then on carry version v's ``LoRARequest``

One slot replaced in place makes an adapter swap behave exactly as a full-weight swap: requests in flight
(``sampler.weight_update = "in_flight"``) go on under the new adapter from the next step, the tokens before the
swap handed back by ``quiesce`` as for any version. vLLM keys its prefix cache by the request's adapter name and
path, and each version has a name and directory of its own (and the requests a new prefix-cache salt at each
load), so KV computed under one version's adapter is never reused under another's. vLLM reads the new adapter
before it evicts the old one: a version that fails to load leaves the previous one serving, and
``GenerationEngine.apply`` loads that one back all the same.

The directory is this module's own because vLLM loads an adapter only from a path (``LoRARequest.lora_path``),
which is also what lets every tensor-parallel worker read it without the version being pickled to each.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.lora import LoraConfig, adapter_config
from services.common.pids import sweep_dead
from services.sampler.engine_staging import LoadNotStarted

if TYPE_CHECKING:
    from services.sampler.engine import _Staged

log = logging.getLogger(__name__)

ADAPTER_DIR = "vcpo-adapters-{pid}"
SLOT = 1  # vLLM's lora_int_id of the one adapter every request carries


class AdapterVersions:
    """The adapter side of :class:`~services.sampler.engine.VllmEngine` (it takes it in); every method falls
    through to the full-weight path when the engine was not built for adapter versions."""

    adapter: LoraConfig | None  # [learner.lora] when versions are adapters
    lora_request: Any  # the LoRARequest of the version loaded now (None: the base alone)
    _staging_root: Path
    _weights_epoch: int
    _current: _Staged | None
    _rpc: Any  # VllmEngine._rpc
    loaded_version: int | None

    def _init_adapters(self, adapter: LoraConfig | None) -> None:
        self.adapter = adapter
        self.lora_request = None
        self._adapter_dirs: dict[int, Path] = {}  # version -> its directory, written and not yet removed
        if adapter is not None:
            sweep_dead(self._staging_root, ADAPTER_DIR.format(pid=r"(\d+)"), "adapter directories", True)

    def _adapter_root(self) -> Path:
        return self._staging_root / ADAPTER_DIR.format(pid=os.getpid())

    def _write_adapter(self, staged: _Staged) -> Path:
        """The version's adapter directory, written now unless it is already; LoadNotStarted if that fails."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        assert self.adapter is not None
        if staged.version in self._adapter_dirs:
            return self._adapter_dirs[staged.version]
        keep = {staged.version} | ({self._current.version} if self._current is not None else set())
        self._drop_adapter_dirs(keep)  # versions written and never applied
        directory = self._adapter_root() / f"v{staged.version}"
        t0 = time.monotonic()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tensors = {name: t.contiguous() for name, t in staged.tensors.items()}
            save_file(tensors, str(directory / "adapter_model.safetensors"))
            (directory / "adapter_config.json").write_text(json.dumps(adapter_config(self.adapter)))
        except (OSError, SafetensorError) as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise LoadNotStarted(
                f"could not write version {staged.version}'s adapter in {self._staging_root} ({exc}); give it "
                "room for two adapters or set VCPO_WEIGHT_STAGING"
            ) from exc
        self._adapter_dirs[staged.version] = directory
        log.debug("version %d's adapter written in %.3fs", staged.version, time.monotonic() - t0)
        return directory

    def _drop_adapter_dirs(self, keep: set[int]) -> None:
        for version in [v for v in self._adapter_dirs if v not in keep]:
            shutil.rmtree(self._adapter_dirs.pop(version), ignore_errors=True)

    def _swap_adapter(self, staged: _Staged) -> None:
        """Put ``staged``'s adapter in the slot (in place), for requests in flight and every later one."""
        from vllm.lora.request import LoRARequest

        directory = self._write_adapter(staged)
        name = f"vcpo-v{staged.version}"
        self._weights_epoch += 1  # whatever happens, nothing computed earlier is reused
        self._rpc("vcpo_load_adapter", name, SLOT, str(directory))
        self.lora_request = LoRARequest(name, SLOT, str(directory))
        self._drop_adapter_dirs({staged.version})

    # ---------------------------------------------------------------- GenerationEngine's weight hooks
    def _prepare(self, staged: _Staged) -> None:
        if self.adapter is None:
            super()._prepare(staged)  # type: ignore[misc]
        else:
            self._write_adapter(staged)

    def _load_staged(self, staged: _Staged) -> None:
        if self.adapter is None:
            super()._load_staged(staged)  # type: ignore[misc]
        else:
            self._swap_adapter(staged)

    def _restore(self) -> None:
        if self.adapter is None:
            super()._restore()  # type: ignore[misc]
        elif self._current is not None:
            self._swap_adapter(self._current)
        else:
            self._unload_adapter()
            self.loaded_version = None

    def _unload_adapter(self) -> None:
        """The base alone, as the learner starts (peft's B = 0: no delta); requests carry no adapter."""
        self._weights_epoch += 1
        self.lora_request = None
        self._rpc("vcpo_unload_adapter", SLOT)
        self._drop_adapter_dirs(set())

    def _close_adapters(self) -> None:
        if self.adapter is not None:
            self._drop_adapter_dirs(set())
            with contextlib.suppress(OSError):
                self._adapter_root().rmdir()
