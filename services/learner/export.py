"""Export a learner checkpoint as an ordinary Hugging Face model directory (for evaluation, vLLM, the hub).

    run dir ─► learner/checkpoints ─► latest ─► step000000120/   (find_checkpoint: from any of the three)
        ├─ zero_pp_rank_0_mp_rank_00_model_states.pt: the learner's client state (step, version)
        └─ get_fp32_state_dict_from_zero_checkpoint: every rank's fp32 partitions ─► full tensors
              (DeepSpeed's own consolidation, on the CPU, no process group)
                 └─ each name and shape checked against the base model's safetensors, cast to its dtype
                       └─ out_dir (a temporary sibling, then renamed): model.safetensors + the base's
                          config.json, generation_config.json, tokenizer, chat template, ...,
                          vcpo_export.json

What it decides:

- A LoRA run's checkpoint holds the adapters, not the frozen base: each adapted weight is exported merged,
  ``W + (alpha / rank)·B A`` (``lora.merged_checkpoint``, in float32 from the adapters' master weights), with
  ``W`` and every other tensor read from the base model.
- The weights are the optimizer's fp32 master weights, consolidated from every rank's partition by DeepSpeed's
  ``zero_to_fp32`` (lazily: one full tensor at a time beside the memory-mapped partitions), then cast to the
  dtype the base model stores each tensor in. That is what the learner published for that version: a bf16
  run's live weights are the same round-to-nearest cast of the same master weights.
- The base model (the one the run started from; a directory or a hub id) is the contract: its tensor names
  and shapes are what the export must hold, exactly. A missing, unknown or mis-shaped tensor is a ValueError
  naming the tensors, never a partial model. A name the checkpoint has and the base lacks is dropped only when
  it is an alias DeepSpeed restored for a tied weight (``lm_head.weight`` of tied embeddings), so tied output
  embeddings appear once, as ``save_pretrained`` writes them.
- Everything else comes from the base directory as it is: config, generation config, tokenizer, chat
  template, every top-level file that is not a weight file or an index of weight files, and not a marker of
  this project (``tiny_model_spec.json``, ``warm_start.json``) that would pass the export off as that build.
- ``step`` and ``version`` are the learner's client state (``Trainer.save_checkpoint``), read from rank 0's
  model-states file; a tag named ``stepNNNNNNNNN`` must agree with it.
- Atomic and idempotent, like ``tiny_model.build_tiny_model``: written into a temporary sibling directory,
  files 0644, ``vcpo_export.json`` ({checkpoint, step, version, base_model}) last, then renamed into place.
  An ``out_dir`` that already holds the export of the same checkpoint tag from the same base is returned as
  it is; one that holds anything else is an error, never overwritten.

Torch, DeepSpeed and safetensors are imported inside the functions so importing this module stays cheap.

Usage: ``python -m services.learner.export CHECKPOINT BASE_MODEL OUT_DIR`` (CHECKPOINT: run, checkpoint or
tag directory)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.model_dirs import resolve_model_dir, write_model_dir
from services.common.tiny_model import SPEC_FILENAME as TINY_MODEL_MARKER
from services.learner.warm_start import MARKER_FILENAME as WARM_START_MARKER

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MARKER_FILENAME = "vcpo_export.json"
WEIGHTS_FILENAME = "model.safetensors"
# rank 0's model states (client state included): ZeRO-3 names it per data-parallel rank, stages 0-2 once
MODEL_STATES = ("zero_pp_rank_0_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt")
# files of a base directory that are weights (replaced by the export's own) or that the export must not claim
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
NOT_COPIED = {MARKER_FILENAME, TINY_MODEL_MARKER, WARM_START_MARKER}
_TAG_STEP = re.compile(r"step(\d+)")
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_MAX_NAMED = 10  # tensors named per kind of mismatch in an error


@dataclass(frozen=True)
class ExportedVersion:
    """A checkpoint exported as a Hugging Face model directory."""

    path: Path  # the HF model directory
    step: int
    version: int
    checkpoint: Path  # the DeepSpeed tag directory it came from


def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*_model_states.pt"))


def find_checkpoint(path: str | Path) -> Path:
    """A DeepSpeed tag directory (e.g. ``<ckpt>/step000000120``) from: a run directory (its
    ``learner/checkpoints``, latest tag), a checkpoint directory with a ``latest`` file, or a tag directory
    itself. A ValueError naming what was looked for otherwise."""
    given = Path(path)
    if not given.is_dir():
        raise ValueError(
            f"{given} is not a directory: expected a run, checkpoint or checkpoint tag directory"
        )
    if _is_tag_dir(given):
        return given.absolute()
    for ckpt_dir in (given, given / "learner" / "checkpoints"):
        latest = ckpt_dir / "latest"
        if latest.is_file():
            tag = latest.read_text().strip()
            if not tag or not _is_tag_dir(ckpt_dir / tag):
                raise ValueError(
                    f"{latest} names the checkpoint tag {tag!r}, but {ckpt_dir / tag} holds no "
                    "*_model_states.pt (deleted, or not a DeepSpeed checkpoint)"
                )
            return (ckpt_dir / tag).absolute()
    raise ValueError(
        f"no learner checkpoint at {given}: looked for a DeepSpeed tag directory (*_model_states.pt in it), "
        f"a checkpoint directory with a 'latest' file ({given / 'latest'}) and a run directory's "
        f"checkpoints ({given / 'learner' / 'checkpoints' / 'latest'}); the learner writes 'latest' only "
        "once every rank's files of a checkpoint are on disk"
    )


def read_client_state(tag_dir: Path) -> tuple[int, int]:
    """``(step, version)`` of a learner checkpoint tag, from the client state in rank 0's model states."""
    step, version, _ = _client_state(tag_dir)
    return step, version


def _client_state(tag_dir: Path) -> tuple[int, int, dict[str, Any] | None]:
    """``(step, version, [learner.lora] of a LoRA run or None)`` of a learner checkpoint tag."""
    import torch

    files = [tag_dir / name for name in MODEL_STATES if (tag_dir / name).is_file()]
    if not files:
        raise ValueError(f"{tag_dir} has none of {', '.join(MODEL_STATES)}: not a DeepSpeed checkpoint tag")
    # a pickle (DeepSpeed's own format, not tensors alone); the module entries are empty under ZeRO-3
    state = torch.load(files[0], map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or "step" not in state or "version" not in state:
        raise ValueError(f"{files[0]} has no 'step' and 'version' client state: not a learner checkpoint")
    step, version = int(state["step"]), int(state["version"])
    named = _TAG_STEP.fullmatch(tag_dir.name)
    if named and int(named.group(1)) != step:
        raise ValueError(f"{tag_dir}: the tag names step {int(named.group(1))}, its client state step {step}")
    return step, version, state.get("lora")


def base_tensors(model_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, torch dtype name) of the safetensors files in ``model_dir`` (headers only)."""
    return {name: (shape, dtype) for name, (_, shape, dtype) in base_tensor_files(model_dir).items()}


def base_tensor_files(model_dir: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """Tensor name -> (its safetensors file, shape, torch dtype name) in ``model_dir`` (headers only)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in the base model {model_dir}")
    out: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                piece = f.get_slice(name)
                stored = piece.get_dtype()
                if stored not in _SAFETENSORS_DTYPES:
                    raise ValueError(f"{path}: {name} is stored as {stored}, not a floating-point dtype")
                out[name] = (path, tuple(piece.get_shape()), _SAFETENSORS_DTYPES[stored])
    return out


def _names(kind: str, items: list[str]) -> str:
    more = f" and {len(items) - _MAX_NAMED} more" if len(items) > _MAX_NAMED else ""
    return f"{len(items)} {kind}: {', '.join(items[:_MAX_NAMED])}{more}"


def check_tensors(state: dict[str, Any], expected: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
    """The names of ``state`` to export, in ``expected``'s order; a ValueError naming every mismatch.

    ``state`` maps names to anything with a ``shape`` (DeepSpeed's lazy tensors). A name ``expected`` lacks
    is left out when its value is the very object of an expected name (a tied weight restored by DeepSpeed).
    """
    kept = {id(state[name]) for name in expected if name in state}
    missing = [name for name in expected if name not in state]
    unknown = [name for name in state if name not in expected and id(state[name]) not in kept]
    shapes = [
        f"{name} {tuple(state[name].shape)} (base {expected[name][0]})"
        for name in expected
        if name in state and tuple(state[name].shape) != expected[name][0]
    ]
    problems = [
        _names(kind, items)
        for kind, items in (
            ("missing from the checkpoint", missing),
            ("not in the base model", unknown),
            ("of another shape", shapes),
        )
        if items
    ]
    if problems:
        raise ValueError("the checkpoint does not match the base model's tensors: " + "; ".join(problems))
    return list(expected)


def _check_lora_base(trained: str, given: str, base_dir: Path, tag_dir: Path) -> None:
    """A LoRA checkpoint's adapters are deltas on the weights of the model its learner loaded: merged into any
    other model (the same shapes, say the model before a warm start), they make a wrong model silently."""
    if not trained:
        return
    same = given == trained or (Path(trained).is_dir() and Path(trained).resolve() == base_dir.resolve())
    if not same:
        raise ValueError(
            f"{tag_dir} is a LoRA checkpoint whose adapters were trained on {trained}; merging them into "
            f"{given} would give another model: export it with {trained} as the base model"
        )


def _existing(out: Path, marker: dict[str, Any]) -> ExportedVersion | None:
    """The export ``out`` already holds of the same checkpoint tag and base; None when ``out`` is free."""
    marker_path = out / MARKER_FILENAME
    if not marker_path.is_file():
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(
                f"{out} exists, is not empty and has no {MARKER_FILENAME}: refusing to overwrite it"
            )
        return None
    found = json.loads(marker_path.read_text())
    same = {key: found.get(key) == marker[key] for key in ("checkpoint", "base_model")}
    if not all(same.values()) or not (out / WEIGHTS_FILENAME).is_file():
        raise ValueError(
            f"{out} already holds an export of {found.get('checkpoint')} (base {found.get('base_model')}), "
            f"not of {marker['checkpoint']} (base {marker['base_model']}); use another directory or delete it"
        )
    return ExportedVersion(out, int(found["step"]), int(found["version"]), Path(found["checkpoint"]))


def _consolidated(tag_dir: Path) -> dict[str, Any]:
    """DeepSpeed's lazy consolidated state dict of one tag (its progress lines go to the debug log)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # zero_to_fp32 print()s; stdout may be a command's output
        state: dict[str, Any] = get_fp32_state_dict_from_zero_checkpoint(
            str(tag_dir.parent), tag=tag_dir.name, lazy_mode=True
        )
    log.debug("zero_to_fp32: %s", printed.getvalue().strip())
    # the learner saves the bare Hugging Face module, so no "module." prefix is expected; strip one if present
    if state and all(name.startswith("module.") for name in state):
        state = {name.removeprefix("module."): value for name, value in state.items()}
    return state


def _materialize(value: Any, dtype: torch.dtype) -> torch.Tensor:
    import torch

    tensor: torch.Tensor = value.contiguous() if not isinstance(value, torch.Tensor) else value
    return tensor.detach().to("cpu", dtype=dtype).contiguous()


def _base_dir(base_model: str) -> Path:
    """The base model's directory: a local one as given, a hub id's snapshot (the sampler's download, plus
    the chat template file that download leaves out)."""
    path = resolve_model_dir(base_model)
    if not Path(base_model).is_dir():
        from huggingface_hub import snapshot_download

        snapshot_download(base_model, allow_patterns=["*.jinja"])  # into the same snapshot directory
    return path


def export_checkpoint(checkpoint: str | Path, base_model: str | Path, out_dir: str | Path) -> ExportedVersion:
    """Write one learner checkpoint tag (or a run's or checkpoint directory's latest) as a Hugging Face model
    directory ``out_dir`` with the base model's config and tokenizer; see the module docstring."""
    import torch
    from safetensors.torch import save_file

    tag_dir = find_checkpoint(checkpoint).resolve()
    base_dir = _base_dir(str(base_model)).resolve()
    out = Path(out_dir).absolute()
    marker: dict[str, Any] = {"checkpoint": str(tag_dir), "base_model": str(base_dir)}
    done = _existing(out, marker)
    if done is not None:
        log.info("%s already holds the export of %s", out, tag_dir)
        return done

    step, version, lora = _client_state(tag_dir)
    files = base_tensor_files(base_dir)
    expected = {name: (shape, dtype) for name, (_, shape, dtype) in files.items()}
    state = _consolidated(tag_dir)
    if lora is not None:  # the adapters alone: merged into the base's weights (lora.merged_checkpoint)
        from services.learner.config import LoraConfig
        from services.learner.lora import merged_checkpoint

        # a checkpoint from before [learner.lora].publish existed published merged versions (any target)
        settings = {"publish": "merged", **lora}
        _check_lora_base(str(settings.pop("base_model", "")), str(base_model), base_dir, tag_dir)
        base = {name: (path, shape) for name, (path, shape, _) in files.items()}
        state = merged_checkpoint(state, base, LoraConfig(**settings))
    names = check_tensors(state, expected)
    tensors: dict[str, torch.Tensor] = {}
    written: dict[int, str] = {}
    for name in names:
        tensor = _materialize(state[name], getattr(torch, expected[name][1]))
        if (
            id(state[name]) in written
        ):  # both names of a tied weight in the base: safetensors wants two tensors
            tensor = tensor.clone()
        written[id(state[name])] = name
        tensors[name] = tensor
    del state

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS_FILENAME), metadata={"format": "pt"})
        tensors.clear()
        for src in sorted(base_dir.iterdir()):
            name = src.name
            if (
                not src.is_file()
                or name.startswith(".")
                or name in NOT_COPIED
                or name.endswith(WEIGHT_SUFFIXES)
                or name.endswith(".index.json")  # the shard index of sharded weights
            ):
                continue
            shutil.copyfile(src, tmp / name)  # follows a hub snapshot's symlinks into its blobs

    marker.update(step=step, version=version)
    # a concurrent export of the same tag may finish first: fine
    write_model_dir(out, fill, MARKER_FILENAME, marker, lambda: _existing(out, marker) is not None)
    log.info("exported %s (step %d, version %d) to %s", tag_dir, step, version, out)
    return ExportedVersion(out, step, version, tag_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Export a learner checkpoint as a Hugging Face model directory."
    )
    parser.add_argument("checkpoint", help="a run directory, a checkpoint directory or a checkpoint tag")
    parser.add_argument("base_model", help="the model the run started from (a directory or a hub id)")
    parser.add_argument("out_dir", help="the model directory to write (or reuse if it holds this export)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    done = export_checkpoint(args.checkpoint, args.base_model, args.out_dir)
    print(f"{done.path} step={done.step} version={done.version} checkpoint={done.checkpoint}")


if __name__ == "__main__":
    main()
