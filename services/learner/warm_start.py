"""A short supervised warm start (SFT) of a model directory, so RL starts from a policy with something to learn.

Why this exists: RL only learns from groups whose rewards differ. A randomly initialised model (the tiny
built-in one) answers nothing right, so every group scores 0 and every advantage is 0. A few seconds of
supervised training on the task's train split teach it the answer *format* (a number, then the end of the
turn) and a modest accuracy; RL then has mixed groups to learn from and room to raise the reward.

    base model dir ──► load_dataset(dataset, split="train", seed) ──► PromptEncoder.encode(task)   (as the sampler)
         │                                        └─► response = the chat template's assistant turn, up to and
         │                                            including the first stop token (what the sampler stops on)
         └─► AdamW on -mean log π(response tokens) ──► save_pretrained into out_dir (atomic, with a marker)

What it decides:

- Prompts are encoded exactly as the sampler encodes them (``load_dataset`` and :class:`PromptEncoder` from
  ``services.common``, same ``system_prompt`` and ``max_model_len``), and the loss covers only the
  response tokens: the answer as the chat template renders the assistant turn, ending with the stop token the
  sampler stops on (the tokenizer's and generation config's EOS, ``<|im_end|>`` for the tiny model). Pass the
  run's seed: builtin datasets are generated from it, so the train split is the sampler's.
- Deterministic for a seed and a thread count: ``torch.manual_seed(seed)``, and batches drawn in a fixed
  order (each epoch of the train split shuffled by ``random.Random(seed + epoch)``). Constant learning rate,
  AdamW without weight decay, gradient clipping at 1.0, float32.
- ``steps=0`` writes the base model unchanged (loaded and saved like any other step count), so callers
  always get a warm-start directory with its marker.
- Atomic and idempotent, like ``tiny_model.build_tiny_model``: built in a temporary sibling directory and
  renamed into place; ``warm_start.json`` records every argument and the base model's identity (its path and
  a SHA-256 of its config, tokenizer and weight files). A complete directory with the same marker is returned
  at once; one with a different marker is an error naming the differences, never overwritten.
- How good the warm-started policy is, as RL sees it, is measured by :mod:`services.learner.policy_sampling`.

Torch and transformers are imported inside the functions so importing this module stays cheap.

Usage: ``python -m services.learner.warm_start BASE OUT --dataset builtin:digit_add --steps 100 [--lr 1e-3]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.model_dirs import write_model_dir

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from vcpo.v1 import rollout_pb2

log = logging.getLogger(__name__)

MARKER_FILENAME = "warm_start.json"
# Bump when the recipe changes (loss, batching, optimiser) so directories made by an older recipe are refused.
RECIPE_VERSION = 1
# What benchmarks/warm_start_rl.py recommends for the tiny model on builtin:digit_add (with 100 steps): a
# sampled reward of about 0.25-0.35 to start RL from, in a few seconds on two CPU cores.
DEFAULT_LR = 1e-3
DEFAULT_BATCH_SIZE = 16
_IDENTITY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
_HASH_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------- examples


@dataclass(frozen=True)
class Example:
    """One supervised example: the sampler's prompt tokens and the response tokens the loss covers."""

    task_id: str
    prompt: list[int]
    response: list[int]  # ends with a stop token


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """The token ids that end a response: the tokenizer's EOS and the generation config's ``eos_token_id``."""
    ids: list[int] = []
    candidates: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    eos = getattr(generation_config, "eos_token_id", None)
    candidates.extend(eos if isinstance(eos, list | tuple) else [eos])
    for token in candidates:
        if token is not None and int(token) not in ids:
            ids.append(int(token))
    if not ids:
        raise ValueError(
            "the tokenizer has no eos_token_id and the generation config none either: no stop token"
        )
    return ids


def build_examples(
    tasks: Sequence[rollout_pb2.Task],
    tokenizer: Any,
    stop_ids: Sequence[int],
    *,
    max_model_len: int,
    system_prompt: str = "",
) -> list[Example]:
    """Each task's prompt (as :class:`PromptEncoder` encodes it) and its reference answer as the response.

    The response is the assistant turn the chat template renders for the reference, up to and including the
    first stop token. Raises ValueError naming the task when the reference is empty, the template does not
    extend the prompt, the turn has no stop token, or prompt and response do not fit in ``max_model_len``.
    """
    from services.common.prompts import PromptEncoder, token_ids

    encoder = PromptEncoder(tokenizer, max_model_len, max_tokens=1, system_prompt=system_prompt)
    stops = set(stop_ids)
    examples = []
    for task in tasks:
        if not task.reference.strip():
            raise ValueError(f"task {task.task_id!r}: empty reference answer; nothing to train on")
        prompt = encoder.encode(task)
        conversation = [*encoder.messages(task), {"role": "assistant", "content": task.reference}]
        full = token_ids(tokenizer.apply_chat_template(conversation, tokenize=True))
        if full[: len(prompt)] != prompt:
            raise ValueError(
                f"task {task.task_id!r}: the chat template's rendering of the answered conversation does not "
                "start with the prompt the sampler encodes; cannot tell the response tokens apart"
            )
        rest = full[len(prompt) :]
        end = next((i for i, token in enumerate(rest) if token in stops), None)
        if end is None:
            raise ValueError(
                f"task {task.task_id!r}: the chat template ends the assistant turn without a stop token "
                f"(stop ids {sorted(stops)}); the sampler would never stop where the warm start teaches it to"
            )
        response = rest[: end + 1]
        if len(prompt) + len(response) > max_model_len:
            raise ValueError(
                f"task {task.task_id!r}: prompt ({len(prompt)} tokens) and answer ({len(response)} tokens) "
                f"exceed max_model_len={max_model_len}"
            )
        examples.append(Example(task.task_id, prompt, response))
    return examples


def batch_order(n_examples: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Example indices of each step's batch: epochs of ``random.Random(seed + epoch)`` orders, cut in batches."""
    order: list[int] = []
    epoch = 0
    while len(order) < steps * batch_size:
        indices = list(range(n_examples))
        random.Random(seed + epoch).shuffle(indices)
        order.extend(indices)
        epoch += 1
    return [order[i * batch_size : (i + 1) * batch_size] for i in range(steps)]


def pad_batch(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, response_mask)`` of ``(prompt, response)`` pairs, padded on the right."""
    import torch

    width = max(len(p) + len(r) for p, r in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    response_mask = torch.zeros_like(ids)
    for row, (prompt, response) in enumerate(sequences):
        n = len(prompt) + len(response)
        ids[row, :n] = torch.tensor([*prompt, *response], dtype=torch.long)
        attention[row, :n] = 1
        response_mask[row, len(prompt) : n] = 1
    return ids, attention, response_mask


# ------------------------------------------------------------------------------------------ warm start


def _check_args(
    steps: int, lr: float, batch_size: int, seed: int, max_model_len: int, log_every: float
) -> None:
    for name, value, low in (("steps", steps, 0), ("batch_size", batch_size, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"warm_start: {name} must be an int >= {low}, got {value!r}")
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
        raise ValueError(f"warm_start: max_model_len must be an int >= 2, got {max_model_len!r}")
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0 or lr == float("inf"):
        raise ValueError(f"warm_start: lr must be a finite number > 0, got {lr!r}")
    if isinstance(log_every, bool) or not isinstance(log_every, int | float) or not log_every > 0:
        raise ValueError(f"warm_start: log_every must be a number of seconds > 0, got {log_every!r}")


def model_identity(base_model: str | os.PathLike[str]) -> dict[str, str]:
    """What the marker records of the base model: a directory's absolute path and the SHA-256 of its config,
    tokenizer and weight files (so a rebuilt directory with other weights is told apart); a hub id as given."""
    path = Path(base_model)
    if not path.is_dir():
        return {"model": str(base_model)}
    digest = hashlib.sha256()
    files = [path / name for name in _IDENTITY_FILES if (path / name).is_file()]
    files += sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    return {"model": str(path.absolute()), "sha256": digest.hexdigest()}


def _check_existing(out_dir: Path, wanted: dict[str, Any]) -> bool:
    """True if ``out_dir`` already holds this warm start; raises if it holds anything else."""
    marker_path = out_dir / MARKER_FILENAME
    if not marker_path.is_file():
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
            raise ValueError(
                f"{out_dir} exists, is not an empty directory and has no {MARKER_FILENAME}: not a warm-start "
                "directory; refusing to overwrite it"
            )
        return False
    found = json.loads(marker_path.read_text())
    if found == wanted:
        return True
    diffs = [
        f"{key}: existing={found.get(key)!r} requested={wanted.get(key)!r}"
        for key in sorted(set(found) | set(wanted))
        if found.get(key) != wanted.get(key)
    ]
    raise ValueError(
        f"{out_dir} already holds a different warm start ({'; '.join(diffs)}); use another directory or "
        "delete this one"
    )


def warm_start(
    base_model: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dataset: str,
    *,
    steps: int,
    lr: float = DEFAULT_LR,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    system_prompt: str = "",
    max_model_len: int = 256,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    threads: int | None = None,
    log_every: float = 5.0,
) -> Path:
    """Fine-tune ``base_model`` on ``dataset``'s train split for ``steps`` steps; save it into ``out_dir``.

    ``batch_size`` examples per step; the loss is the mean negative log-likelihood of the response tokens of
    the batch. ``threads`` sets torch's intra-op threads while training (None: at most 4, the CPUs this
    process may use). Returns ``out_dir``'s absolute path. See the module docstring for what it decides.
    """
    _check_args(steps, lr, batch_size, seed, max_model_len, log_every)
    out = Path(out_dir).absolute()
    marker = {
        "recipe_version": RECIPE_VERSION,
        "base_model": model_identity(base_model),
        "dataset": dataset,
        "steps": steps,
        "lr": float(lr),
        "batch_size": batch_size,
        "seed": seed,
        "system_prompt": system_prompt,
        "max_model_len": max_model_len,
        "prompt_field": prompt_field,
        "answer_field": answer_field,
    }
    if _check_existing(out, marker):
        log.info("warm start: %s already holds this warm start", out)
        return out

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.common.datasets import load_dataset

    tasks = load_dataset(dataset, prompt_field, answer_field, split="train", seed=seed)
    if not tasks:
        raise ValueError(f"warm_start: dataset {dataset!r} has no train rows")
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    examples = build_examples(
        tasks,
        tokenizer,
        stop_token_ids(tokenizer, model.generation_config),
        max_model_len=max_model_len,
        system_prompt=system_prompt,
    )
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads())
    try:
        train(
            model,
            examples,
            pad_token_id(tokenizer),
            steps=steps,
            lr=lr,
            batch_size=batch_size,
            seed=seed,
            log_every=log_every,
        )
    finally:
        torch.set_num_threads(threads_before)
    _save_atomically(model, tokenizer, out, marker)
    return out


def default_threads() -> int:
    """At most 4 intra-op threads (a model this small gains nothing from more), within this process's CPUs."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pad_token_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token to pad batches with")
    return int(pad)


def train(
    model: PreTrainedModel,
    examples: Sequence[Example],
    pad_id: int,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    log_every: float = 5.0,
) -> list[float]:
    """The SFT loop, in place on ``model``; returns each step's loss (mean NLL of the response tokens)."""
    import torch

    from services.learner.logprobs import token_logprobs

    if not examples:
        raise ValueError("warm_start: no examples to train on")
    torch.manual_seed(seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses: list[float] = []
    start = last_log = time.monotonic()
    for step, batch in enumerate(batch_order(len(examples), steps, batch_size, seed), start=1):
        ids, attention, response_mask = pad_batch(
            [(examples[i].prompt, examples[i].response) for i in batch], pad_id
        )
        logp = token_logprobs(model, ids, attention)
        mask = response_mask.bool()
        loss = -torch.where(mask, logp, torch.zeros_like(logp)).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        now = time.monotonic()
        if now - last_log >= log_every or step == steps:
            log.info("warm start: step %d/%d loss %.4f elapsed %.1fs", step, steps, losses[-1], now - start)
            last_log = now
    model.eval()
    return losses


def _save_atomically(model: PreTrainedModel, tokenizer: Any, out: Path, marker: dict[str, Any]) -> None:
    from transformers.utils import logging as hf_logging

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp)  # weights, config and generation config
        tokenizer.save_pretrained(tmp)

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        # a concurrent warm start may finish first: fine if it made the same one
        write_model_dir(out, fill, MARKER_FILENAME, marker, lambda: _check_existing(out, marker))
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# ------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Supervised warm start of a model on a dataset's train split."
    )
    parser.add_argument("base_model", metavar="BASE", help="model directory (or hub id) to start from")
    parser.add_argument("out_dir", metavar="OUT", help="directory to create (or reuse if already made)")
    parser.add_argument("--dataset", required=True, help="a .jsonl/.parquet file or builtin:<name>")
    parser.add_argument("--steps", type=int, required=True, help="optimiser steps (0: copy the base model)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help="AdamW learning rate (constant)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="examples per step")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (builtin data and batch order)")
    parser.add_argument("--system-prompt", default="", help="as the sampler's system_prompt")
    parser.add_argument("--max-model-len", type=int, default=256, help="as the sampler's max_model_len")
    parser.add_argument("--prompt-field", default="prompt")
    parser.add_argument("--answer-field", default="answer")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: at most 4)")
    parser.add_argument(
        "--eval-prompts", type=int, default=0, help="then print the sampled reward on N prompts"
    )
    options = vars(parser.parse_args(argv))
    eval_prompts = options.pop("eval_prompts")
    base, out, dataset = options.pop("base_model"), options.pop("out_dir"), options.pop("dataset")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()
    path = warm_start(base, out, dataset, **options)  # the flags' names are warm_start's keywords
    print(f"{path} ({time.monotonic() - t0:.1f}s)")
    if eval_prompts:
        from services.learner.policy_sampling import sampled_reward

        reward = sampled_reward(
            path,
            dataset,
            n_prompts=eval_prompts,
            n_samples=8,
            seed=options["seed"],
            system_prompt=options["system_prompt"],
            max_model_len=options["max_model_len"],
        )
        print(f"sampled reward (temperature 1, 8 samples x {eval_prompts} prompts): {reward:.3f}")


if __name__ == "__main__":
    main()
