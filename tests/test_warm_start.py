"""The supervised warm start: response tokens as the sampler stops, determinism, marker and idempotence."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.datasets import load_dataset
from services.common.prompts import PromptEncoder
from services.common.tiny_model import IM_END
from services.learner.policy_sampling import sample_responses, sampled_reward
from services.learner.warm_start import (
    MARKER_FILENAME,
    batch_order,
    build_examples,
    main,
    pad_token_id,
    stop_token_ids,
    train,
    warm_start,
)

DATASET = "builtin:digit_add"


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """One intra-op thread (warm_start is passed threads=1 too): the tiny model gains little from more, and
    spinning threads on a busy shared machine make these tests many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def test_response_tokens_are_the_answer_then_the_samplers_stop_token(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    stops = stop_token_ids(tokenizer, model.generation_config)
    assert stops == [tokenizer.convert_tokens_to_ids(IM_END)]  # what vLLM stops on: the EOS
    tasks = load_dataset(DATASET, seed=0)[:10]
    examples = build_examples(tasks, tokenizer, stops, max_model_len=256, system_prompt="Be brief.")
    encoder = PromptEncoder(tokenizer, 256, 32, system_prompt="Be brief.")
    for task, example in zip(tasks, examples, strict=True):
        assert example.prompt == encoder.encode(task)  # exactly the sampler's prompt
        assert example.response[-1] == stops[0] and stops[0] not in example.response[:-1]
        assert tokenizer.decode(example.response, skip_special_tokens=True) == task.reference


def test_an_example_that_does_not_fit_is_named(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tasks = load_dataset(DATASET, seed=0)[:1]
    prompt_len = len(PromptEncoder(tokenizer, 256, 1).encode(tasks[0]))
    with pytest.raises(ValueError, match=r"task 'digit_add:0'.*exceed max_model_len"):
        build_examples(tasks, tokenizer, stop_token_ids(tokenizer), max_model_len=prompt_len + 1)


def test_batch_order_is_fixed_and_covers_each_epoch() -> None:
    order = batch_order(10, steps=5, batch_size=4, seed=3)
    assert order == batch_order(10, steps=5, batch_size=4, seed=3)
    assert order != batch_order(10, steps=5, batch_size=4, seed=4)
    flat = [i for batch in order for i in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))


def test_loss_decreases(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    examples = build_examples(
        load_dataset(DATASET, seed=0), tokenizer, stop_token_ids(tokenizer), max_model_len=256
    )
    losses = train(model, examples, pad_token_id(tokenizer), steps=30, lr=3e-3, batch_size=16, seed=0)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def test_warm_start_is_deterministic_atomic_and_idempotent(tiny_model_dir: Path, tmp_path: Path) -> None:
    kwargs = {"steps": 5, "lr": 3e-3, "batch_size": 8, "seed": 0, "threads": 1}
    out = warm_start(tiny_model_dir, tmp_path / "ws", DATASET, **kwargs)  # type: ignore[arg-type]
    assert out == (tmp_path / "ws").absolute()
    assert [p.name for p in tmp_path.iterdir()] == ["ws"]  # no temporary directory left behind
    marker = json.loads((out / MARKER_FILENAME).read_text())
    assert marker["dataset"] == DATASET and marker["steps"] == 5 and marker["lr"] == 3e-3
    assert marker["base_model"]["model"] == str(tiny_model_dir) and len(marker["base_model"]["sha256"]) == 64
    # an ordinary model directory: what vLLM and the learner load
    AutoTokenizer.from_pretrained(out)
    trained = _weights(out)
    assert any(not torch.equal(trained[k], v) for k, v in _weights(tiny_model_dir).items())

    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert warm_start(tiny_model_dir, out, DATASET, **kwargs) == out  # type: ignore[arg-type]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # returned, not rebuilt

    again = _weights(warm_start(tiny_model_dir, tmp_path / "again", DATASET, **kwargs))  # type: ignore[arg-type]
    assert all(torch.equal(v, again[k]) for k, v in trained.items())  # same seed, same weights


def test_a_different_warm_start_is_refused_not_overwritten(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = warm_start(tiny_model_dir, tmp_path / "ws", DATASET, steps=1, lr=1e-3, batch_size=4, threads=1)
    with pytest.raises(
        ValueError,
        match=r"different warm start \(lr: existing=0.001 requested=0.002; "
        r"steps: existing=1 requested=2\)",
    ):
        warm_start(tiny_model_dir, out, DATASET, steps=2, lr=2e-3, batch_size=4, threads=1)
    assert json.loads((out / MARKER_FILENAME).read_text())["steps"] == 1  # left as it was
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a warm-start directory; refusing to overwrite it"):
        warm_start(tiny_model_dir, tmp_path / "other", DATASET, steps=1, lr=1e-3, batch_size=4, threads=1)


def test_zero_steps_saves_the_base_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = warm_start(tiny_model_dir, tmp_path / "ws", DATASET, steps=0, lr=1e-3, batch_size=4, threads=1)
    base = _weights(tiny_model_dir)
    assert all(torch.equal(v, base[k]) for k, v in _weights(out).items())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"steps": -1}, "steps must be an int >= 0, got -1"),
        ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
        ({"lr": 0.0}, "lr must be a finite number > 0, got 0.0"),
        ({"max_model_len": 1}, "max_model_len must be an int >= 2, got 1"),
    ],
)
def test_bad_arguments_are_named(tiny_model_dir: Path, tmp_path: Path, change: dict, match: str) -> None:
    kwargs = {"steps": 1, "lr": 1e-3, "batch_size": 4, **change}
    with pytest.raises(ValueError, match=match):
        warm_start(tiny_model_dir, tmp_path / "ws", DATASET, **kwargs)
    assert not (tmp_path / "ws").exists()


def test_an_empty_dataset_is_an_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"dataset '.*empty.jsonl' has no train rows"):
        warm_start(tiny_model_dir, tmp_path / "ws", str(empty), steps=1, lr=1e-3, batch_size=4, threads=1)


def test_sampled_responses_stop_at_the_stop_token(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    encoder = PromptEncoder(tokenizer, 256, 8)
    tasks = load_dataset("builtin:arith", seed=0)[:3]  # prompts of different lengths
    stop = tokenizer.convert_tokens_to_ids(IM_END)

    def sample(seed: int) -> list[list[list[int]]]:
        return sample_responses(
            model,
            [encoder.encode(t) for t in tasks],
            n=4,
            max_tokens=8,
            stop_ids=[stop],
            pad_id=pad_token_id(tokenizer),
            generator=torch.Generator().manual_seed(seed),
        )

    responses = sample(0)
    assert [len(group) for group in responses] == [4, 4, 4]
    for response in (r for group in responses for r in group):
        assert 1 <= len(response) <= 8
        assert stop not in response[:-1] and (response[-1] == stop or len(response) == 8)
    assert sample(0) == responses


def test_sampled_reward_and_the_cli(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = f"--dataset {DATASET} --steps 100 --lr 1e-3 --threads 1".split()
    main([str(tiny_model_dir), str(tmp_path / "ws"), *flags])
    assert str(tmp_path / "ws") in capsys.readouterr().out
    trained = sampled_reward(tmp_path / "ws", DATASET, n_prompts=20, n_samples=4)
    base = sampled_reward(tiny_model_dir, DATASET, n_prompts=20, n_samples=4, max_tokens=4)
    assert base < 0.05 < trained <= 1.0  # the random model answers nothing right; the warm start does
