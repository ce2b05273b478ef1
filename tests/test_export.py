"""A real ZeRO-3 learner checkpoint (2 gloo ranks) exported as a Hugging Face model directory: exactly the
trained weights, loadable by transformers, found from a run, checkpoint or tag directory, reused when done,
and refused with clear errors for a wrong base model or a missing checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.tiny_model import SPEC_FILENAME, TinyModelSpec, build_tiny_model
from services.learner.config import LearnerConfig
from services.learner.export import MARKER_FILENAME, ExportedVersion, export_checkpoint, find_checkpoint
from services.learner.local_ranks import run_ranks, scored_groups

pytestmark = pytest.mark.slow

STEPS = 2
PROMPT = [{"role": "user", "content": "What is 3+4?"}]


def _train(rank: int, runs: list[tuple[str, str]], steps: list[Any]) -> list[list[dict[str, Any]]]:
    """For each (model, run dir): train ``steps`` on a fresh ZeRO-3 engine, checkpointing after every step;
    rank 0 returns the weights gathered from the live engine after each step (the publish path)."""
    from services.learner.batching import place_groups, to_tensors
    from services.learner.publish import gathered_tensors
    from services.learner.trainer import Trainer

    world = int(os.environ["WORLD_SIZE"])
    out = []
    for model_dir, run_dir in runs:
        trainer = Trainer(LearnerConfig(micro_batch_size=2, lr=1e-2), model_dir)
        per_step = []
        for groups in steps:
            mine = [groups[i] for i in place_groups(groups, world)[rank]]
            result = trainer.train_step(to_tensors(mine))
            assert result.metrics["step_skipped"] == 0
            trainer.save_checkpoint(Path(run_dir) / "learner" / "checkpoints", {"feed": None}, keep=STEPS)
            weights = {n: t.numpy().copy() for n, t in gathered_tensors(trainer.module)}
            per_step.append(weights if rank == 0 else {})
        out.append(per_step)
    return out


@dataclass
class Trained:
    base: Path  # the model the runs started from (untied embeddings, float32)
    tied_base: Path  # the same with tied embeddings
    run: Path  # a run directory trained from `base`
    tied_run: Path
    weights: list[dict[str, torch.Tensor]]  # gathered after step 1, 2 of `run`
    tied_weights: list[dict[str, torch.Tensor]]

    def tag(self, step: int, run: Path | None = None) -> Path:
        return (run or self.run) / "learner" / "checkpoints" / f"step{step:09d}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    tmp = tmp_path_factory.mktemp("export")
    base = build_tiny_model(tmp / "model", TinyModelSpec())
    tied_base = build_tiny_model(tmp / "model-tied", TinyModelSpec(tie_word_embeddings=True))
    steps = [scored_groups(base, [2, 3, 2], seed=s) for s in range(STEPS)]
    runs = [(str(base), str(tmp / "run")), (str(tied_base), str(tmp / "run-tied"))]
    plain, tied = run_ranks(_train, 2, runs, steps)[0]

    def tensors(per_step: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        return [{n: torch.from_numpy(a) for n, a in weights.items()} for weights in per_step]

    return Trained(base, tied_base, tmp / "run", tmp / "run-tied", tensors(plain), tensors(tied))


def _load(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def _assert_equal_weights(exported: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name


def test_the_export_holds_exactly_the_trained_weights(trained: Trained, tmp_path: Path) -> None:
    base_tensors = _load(trained.base)
    for step in range(1, STEPS + 1):
        out = tmp_path / f"v{step}"
        done = export_checkpoint(trained.tag(step), trained.base, out)
        assert done == ExportedVersion(out, step, step, trained.tag(step).resolve())
        exported = _load(out)
        assert exported.keys() == base_tensors.keys()
        _assert_equal_weights(exported, trained.weights[step - 1])
        assert any(not torch.equal(exported[n], t) for n, t in base_tensors.items())  # training moved them
        marker = json.loads((out / MARKER_FILENAME).read_text())
        assert (marker["checkpoint"], marker["step"], marker["version"]) == (str(done.checkpoint), step, step)

    # the base's non-weight files, byte for byte, but not the tiny model's marker (the weights are not its)
    copied = {p.name for p in trained.base.iterdir()} - {SPEC_FILENAME}
    assert {p.name for p in out.iterdir()} == copied | {MARKER_FILENAME}
    assert {"config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"} <= copied
    for name in copied - {"model.safetensors"}:
        assert (out / name).read_bytes() == (trained.base / name).read_bytes(), name
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in out.iterdir())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind


def test_tied_embeddings_appear_once_as_in_save_pretrained(trained: Trained, tmp_path: Path) -> None:
    base_names = set(_load(trained.tied_base))
    assert "lm_head.weight" not in base_names
    export_checkpoint(trained.tied_run, trained.tied_base, tmp_path / "tied")
    exported = _load(tmp_path / "tied")
    assert set(exported) == base_names
    _assert_equal_weights(exported, trained.tied_weights[-1])


def test_weights_are_cast_to_the_dtype_the_base_stores(trained: Trained, tmp_path: Path) -> None:
    # the same model stored in bfloat16: the export takes its dtype (and config) from the base
    bf16 = build_tiny_model(tmp_path / "model-bf16", TinyModelSpec(dtype="bfloat16"))
    export_checkpoint(trained.run, bf16, tmp_path / "bf16")
    exported = _load(tmp_path / "bf16")
    _assert_equal_weights(exported, {n: t.to(torch.bfloat16) for n, t in trained.weights[-1].items()})
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_transformers_loads_the_export_and_it_computes_the_trained_policy(
    trained: Trained, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_checkpoint(trained.run, trained.base, tmp_path / "hf").path
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = ids["input_ids"]

    def logits(model: Any) -> torch.Tensor:
        with torch.no_grad():
            return model.eval()(ids).logits

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(trained.base, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(trained.base, dtype=torch.float32)
    missing, unexpected = reference.load_state_dict(trained.weights[-1], strict=True)
    assert (missing, unexpected) == ([], [])
    assert (logits(exported) - logits(base)).abs().max() > 1e-3  # training changed the policy
    assert torch.equal(logits(exported), logits(reference))  # and the export is the trained one


def test_find_checkpoint_from_a_run_a_checkpoint_or_a_tag_directory(trained: Trained, tmp_path: Path) -> None:
    latest = trained.tag(STEPS).absolute()
    assert find_checkpoint(trained.run) == latest
    assert find_checkpoint(str(trained.run / "learner" / "checkpoints")) == latest
    assert find_checkpoint(trained.tag(1)) == trained.tag(1).absolute()
    assert export_checkpoint(trained.run, trained.base, tmp_path / "latest").step == STEPS


def test_no_checkpoint_is_a_clear_error(trained: Trained, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no learner checkpoint at .*'latest' file.*learner/checkpoints"):
        find_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        find_checkpoint(tmp_path / "nowhere")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("step000000009")
    with pytest.raises(ValueError, match=r"names the checkpoint tag 'step000000009'.*holds no"):
        export_checkpoint(tmp_path / "ckpt", trained.base, tmp_path / "out")
    # a tag whose name disagrees with the step in its client state
    shutil.copytree(trained.tag(1), tmp_path / "ckpt" / "step000000007")
    with pytest.raises(ValueError, match="the tag names step 7, its client state step 1"):
        export_checkpoint(tmp_path / "ckpt" / "step000000007", trained.base, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (  # another hidden size: every tensor of another shape
            TinyModelSpec(hidden_size=64, num_attention_heads=2, num_key_value_heads=1),
            r"51 of another shape: .*model\.embed_tokens\.weight \(512, 128\) \(base \(512, 64\)\)",
        ),
        (  # a deeper model: the checkpoint lacks a layer
            TinyModelSpec(num_hidden_layers=5),
            r"missing from the checkpoint: model\.layers\.4\.",
        ),
        (  # a shallower model: the checkpoint has a layer too many
            TinyModelSpec(num_hidden_layers=3),
            r"not in the base model: model\.layers\.3\.",
        ),
        (  # tied embeddings: no place for the trained output head
            TinyModelSpec(tie_word_embeddings=True),
            r"1 not in the base model: lm_head\.weight$",
        ),
    ],
    ids=["hidden-size", "deeper", "shallower", "tied"],
)
def test_a_base_model_of_other_shapes_is_refused(
    trained: Trained, tmp_path: Path, spec: TinyModelSpec, match: str
) -> None:
    other = build_tiny_model(tmp_path / "other", spec)
    with pytest.raises(ValueError, match=match):
        export_checkpoint(trained.run, other, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["other"]


def test_a_second_export_of_the_same_tag_is_reused(trained: Trained, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    first = export_checkpoint(trained.tag(STEPS), trained.base, out)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = export_checkpoint(trained.run, str(trained.base), out)  # the same tag, reached from the run
    assert again == first
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    # another tag, or another base, into the same directory is refused, not overwritten
    with pytest.raises(
        ValueError, match=r"already holds an export of .*step000000002.*not of .*step000000001"
    ):
        export_checkpoint(trained.tag(1), trained.base, out)
    with pytest.raises(ValueError, match="already holds an export"):
        export_checkpoint(trained.tied_run, trained.tied_base, out)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    # a directory with something else in it is never overwritten either
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"is not empty and has no vcpo_export\.json"):
        export_checkpoint(trained.run, trained.base, tmp_path / "busy")
    # an empty directory is fine
    (tmp_path / "empty").mkdir()
    assert export_checkpoint(trained.run, trained.base, tmp_path / "empty").step == STEPS
