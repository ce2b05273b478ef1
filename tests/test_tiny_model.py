"""The tiny model factory: loads through the ordinary hub path, is deterministic, idempotent, and runs in vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from services.common import tiny_model
from services.common.tiny_model import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    SPEC_FILENAME,
    TinyModelSpec,
    build_tiny_model,
    count_parameters,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

ROUND_TRIP_TEXTS = [
    "",
    "12+7=19",
    "What is 345*12? The answer is 4140.",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nnewlines\n\n\nand more",
    "héllo wörld, naïve café — “quotes” …",
    "你好，世界。こんにちは 안녕하세요 Привет мир",
    "emoji 🙂🚀👩‍💻 and flags 🇫🇷",
    "control \x00\x01\x1f\x7f bytes",
    "".join(chr(c) for c in range(256)),
    f"{IM_START}user\nhi{IM_END}\n{ENDOFTEXT}",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _state_dict(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def test_loads_as_an_untied_qwen2_causal_lm(model_dir: Path, tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = model.config
    assert config.model_type == "qwen2"
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert config.hidden_size // config.num_attention_heads in (32, 64)
    assert config.use_sliding_window is False
    assert config.vocab_size == len(tokenizer) == TinyModelSpec().vocab_size
    assert model.dtype == torch.float32

    n_params = sum(p.numel() for p in model.parameters())
    assert 2e5 <= n_params <= 5e6
    assert count_parameters(model_dir) == n_params
    assert (model_dir / "model.safetensors").is_file()
    assert (model_dir / "generation_config.json").is_file()

    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode("12+7=19")])).logits
    assert logits.shape == (1, 7, config.vocab_size)
    assert torch.isfinite(logits).all()


def test_same_spec_gives_identical_files_and_another_seed_other_weights(
    model_dir: Path, tmp_path: Path
) -> None:
    import torch

    again = build_tiny_model(tmp_path / "again")
    assert (again / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert (again / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    reference = _state_dict(model_dir)
    rebuilt = _state_dict(again)
    assert reference.keys() == rebuilt.keys()
    assert all(torch.equal(reference[k], rebuilt[k]) for k in reference)

    other = build_tiny_model(tmp_path / "seed1", TinyModelSpec(seed=1))
    # the tokenizer depends on the vocabulary size only, the weights on the seed
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    reseeded = _state_dict(other)
    assert not torch.equal(reference["model.embed_tokens.weight"], reseeded["model.embed_tokens.weight"])
    assert not torch.equal(reference["lm_head.weight"], reseeded["lm_head.weight"])


def test_build_leaves_global_torch_rng_alone(tmp_path: Path) -> None:
    import torch

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", TinyModelSpec(seed=7))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text(tokenizer, text: str) -> None:
    assert unicodedata.is_normalized("NFC", text)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    if ENDOFTEXT not in text:
        assert tokenizer.pad_token_id not in ids  # <|endoftext|> doubles as unk: nothing fell back to it


def test_tokenizer_covers_every_byte_and_splits_digits(tokenizer) -> None:
    from tokenizers import pre_tokenizers

    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(tokenizer.get_vocab())
    assert tokenizer.tokenize("12+7=19") == list("12+7=19")
    assert tokenizer.tokenize(" 2048") == ["Ġ", "2", "0", "4", "8"]
    # like Qwen2, input is NFC-normalised first: a decomposed "é" comes back composed
    assert tokenizer.decode(tokenizer.encode("cafe\u0301")) == "café"


def test_reloaded_tokenizer_keeps_the_saved_pipeline(model_dir: Path, tokenizer) -> None:
    # transformers 5 reloads any qwen2 directory as Qwen2Tokenizer, which rebuilds its own normalizer,
    # pre-tokenizer and decoder around the saved vocabulary: they must be the ones that were saved.
    saved = json.loads((model_dir / "tokenizer.json").read_text())
    loaded = json.loads(tokenizer.backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "decoder", "added_tokens"):
        assert loaded[part] == saved[part], part
    assert loaded["model"]["vocab"] == saved["model"]["vocab"]
    assert loaded["model"]["merges"] == saved["model"]["merges"]


def test_special_tokens_and_ids(model_dir: Path, tokenizer) -> None:
    from transformers import AutoConfig, GenerationConfig

    assert tokenizer.eos_token == IM_END
    assert tokenizer.pad_token == ENDOFTEXT
    assert tokenizer.convert_tokens_to_ids(IM_START) != tokenizer.unk_token_id
    assert {IM_START, IM_END, ENDOFTEXT} <= set(tokenizer.all_special_tokens)
    config = AutoConfig.from_pretrained(model_dir)
    generation = GenerationConfig.from_pretrained(model_dir)
    for ids in (config, generation):
        assert ids.eos_token_id == tokenizer.eos_token_id
        assert ids.pad_token_id == tokenizer.pad_token_id
        assert ids.bos_token_id == tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    assert (
        tokenizer.decode(tokenizer.encode(f"{IM_START}user\nhi{IM_END}"), skip_special_tokens=True)
        == "user\nhi"
    )


def test_chat_template_renders_qwen_style(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12+7?"},
    ]
    conversation = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 12+7?<|im_end|>\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == conversation
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == conversation + "<|im_start|>assistant\n"
    ids = tokenizer.encode(prompt)
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_START)) == 3
    assert ids.count(tokenizer.eos_token_id) == 2


def test_second_build_is_a_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = build_tiny_model(tmp_path / "m")
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert SPEC_FILENAME in mtimes
    assert json.loads((out / SPEC_FILENAME).read_text())["spec"] == TinyModelSpec().to_json_dict()

    def must_not_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("an existing complete build was rebuilt")

    monkeypatch.setattr(tiny_model, "build_tokenizer", must_not_build)
    monkeypatch.setattr(tiny_model, "build_model", must_not_build)
    assert build_tiny_model(tmp_path / "m", TinyModelSpec()) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary directory left behind


def test_conflicting_spec_or_foreign_directory_is_refused(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "m")
    with pytest.raises(ValueError, match=r"seed: existing=0 requested=1"):
        build_tiny_model(out, TinyModelSpec(seed=1))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a tiny-model directory"):
        build_tiny_model(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert (build_tiny_model(tmp_path / "empty") / SPEC_FILENAME).is_file()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_attention_heads": 8}, "= 16"),
        ({"hidden_size": 128, "num_attention_heads": 1}, "= 128"),
        ({"hidden_size": 130}, "hidden_size=130"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"vocab_size": 100}, "100"),
        ({"dtype": "float64"}, "float64"),
        ({"seed": -1}, "-1"),
    ],
)
def test_invalid_spec_names_the_bad_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyModelSpec(**kwargs)


def test_vocab_larger_than_the_corpus_supports_is_refused() -> None:
    with pytest.raises(ValueError, match="vocab_size=4096"):
        tiny_model.build_tokenizer(TinyModelSpec(vocab_size=4096))


def test_cli_builds_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny_model.main([str(tmp_path / "cli"), "--seed", "3", "--no-tie-word-embeddings"])
    out = capsys.readouterr().out
    assert str(tmp_path / "cli") in out
    assert f"parameters={count_parameters(tmp_path / 'cli')}" in out
    assert json.loads((tmp_path / "cli" / SPEC_FILENAME).read_text())["spec"]["seed"] == 3


def test_importing_the_module_is_cheap() -> None:
    code = (
        "import sys, services.common.tiny_model\n"
        "heavy = {'torch', 'transformers', 'tokenizers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


@pytest.mark.slow
def test_vllm_logprobs_match_hugging_face(model_dir: Path, tokenizer, vllm_engine) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from tests.sampler_helpers import assert_logprobs_match, load_into

    # the session's one vLLM engine (CPU build, in this process), given this model's weights
    load_into(vllm_engine, load_file(model_dir / "model.safetensors"))
    prompts = [
        "12+7=",
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 3+4?"}], tokenize=False, add_generation_prompt=True
        ),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    outputs = vllm_engine.llm.generate(prompts, params, use_tqdm=False)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        prompt_ids = list(output.prompt_token_ids)
        assert prompt_ids == tokenizer.encode(prompt)
        completion = output.outputs[0]
        generated = list(completion.token_ids)
        assert len(generated) == 6
        vllm_logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs, generated, strict=True)
        ]
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + generated])).logits[0]
        hf_logprobs = torch.log_softmax(logits.float(), dim=-1)[len(prompt_ids) - 1 : -1]
        expected = hf_logprobs.gather(1, torch.tensor(generated)[:, None]).squeeze(1)
        # greedy agrees (up to ties closer than the tolerance: a random tiny model is nearly uniform)
        assert (hf_logprobs.max(dim=-1).values - expected).max() <= 1e-4
        torch.testing.assert_close(torch.tensor(vllm_logprobs), expected, atol=1e-4, rtol=0)
        assert_logprobs_match(vllm_logprobs, expected)  # and their sum, a response's log-weight
