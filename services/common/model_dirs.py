"""Model directories: where a model named in a config is on disk, the tensor shapes of its checkpoint, and
how a new one is written safely.

Three writers make Hugging Face model directories that other processes load while runs go on: the tiny model
(``services.common.tiny_model``), the supervised warm start (``services.learner.warm_start``) and the export
of a learner checkpoint (``services.learner.export``). They all write the same way, decided here:

- Into a hidden temporary sibling of the target, then one ``os.rename``: a reader sees no directory or a
  complete one, never a half-written one. A rename onto an empty directory replaces it.
- Every file 0644 and the directory 0755: safetensors are written 0600, and the sampler and learner may run
  as other users (other pods) than the writer.
- A marker file (JSON) written last, whose presence says the directory is complete and what made it.
- Two writers racing for one target: the loser's rename fails, and it is fine when the winner made the same
  thing (the caller's ``already_done`` says so); otherwise the error propagates.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# The files of a hub model that the services load: config and generation config, tokenizer (JSON, merges,
# sentencepiece), chat template, safetensors weights. Not *.bin / *.pt / *.h5 / *.gguf copies of the same
# weights, which many repositories also carry and which would double or triple the download.
MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja")


def resolve_model_dir(model: str) -> Path:
    """A local directory as given; a hub id as its local snapshot (downloaded if needed). The launcher hands
    every service a local directory (``deploy/model_fetch.py``), so a hub id reaches here only where a service
    is started on its own."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=list(MODEL_FILES)))


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the safetensors checkpoint in ``model_dir`` (what every version must match)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def write_model_dir(
    out: Path,
    fill: Callable[[Path], None],
    marker_file: str,
    marker: Mapping[str, Any],
    already_done: Callable[[], bool],
) -> None:
    """Write the directory ``out`` atomically: ``fill(tmp)`` writes its files into a temporary sibling, the
    marker is written last, then the sibling is renamed to ``out``. ``already_done()`` is asked when the rename
    fails (a concurrent writer finished first): True if ``out`` now holds what this call was making."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        fill(tmp)
        # written last: its presence means the directory is complete
        (tmp / marker_file).write_text(json.dumps(dict(marker), indent=2, sort_keys=True) + "\n")
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out)  # atomic; also replaces an empty `out`
        except OSError:
            if not already_done():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
