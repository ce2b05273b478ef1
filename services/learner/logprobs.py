"""Token log-probs of a causal LM, whole or with the output head in slices of the positions.

Every path of the learner's step scores trajectories here: ``token_logprobs`` gives
``log π(token_t | prefix)`` per position, and ``chunked_logprobs`` does the same with the vocabulary-sized
work (output head, float32 logits, log-softmax) over slices of the positions, so no ``[B, T, vocab]`` tensor
exists at once. Positions skip left padding (``position_ids_from_mask``), so a padded row scores exactly like
the unpadded sequence. Sums of products are formed in float32 at least (:func:`acc`): bf16 would round at
every addition.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of ``dtype``: float32 for bf16/fp16 (their sums of products would round at
    every addition), float32 and float64 as they are."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def acc(t: Tensor) -> Tensor:
    """``t`` in its accumulation dtype (:func:`acc_dtype`)."""
    return t.to(acc_dtype(t.dtype))


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, so a padded row scores exactly like the unpadded sequence."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, chunks: int = 0) -> Tensor:
    """[B, T] log π(input_ids[:, t] | input_ids[:, <t]) in float32 (float64 for a float64 model); column 0
    (nothing predicts it) is 0.

    ``chunks > 0``: the output head and the log-softmax run over that many slices of the positions, each
    recomputed in the backward (:func:`chunked_logprobs`), so no [B, T, vocab] tensor exists at once.
    """
    if chunks > 0:
        return chunked_logprobs(model, input_ids, attention_mask, chunks)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    ).logits
    logp = torch.log_softmax(acc(logits[:, :-1]), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([logp.new_zeros(logp.shape[0], 1), logp], dim=1)


def chunk_count(tokens: int, chunk_tokens: int) -> int:
    """Slices of a ``tokens``-wide row's positions for ``chunk_tokens`` at a time (0: one pass, unchunked)."""
    positions = tokens - 1
    if chunk_tokens <= 0 or positions <= chunk_tokens:
        return 0
    return -(-positions // chunk_tokens)


# causal LMs whose logits are exactly ``lm_head(decoder(...))``: no soft-capping, scaling or bias term
CHUNKABLE_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The model's decoder (hidden states after the final norm) and output head (an ``nn.Linear``, or peft's
    LoRA on one), for chunked log-probs."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    linear = isinstance(head, nn.Linear) or isinstance(getattr(head, "base_layer", None), nn.Linear)
    if model_type not in CHUNKABLE_MODEL_TYPES or not linear or decoder is None:
        raise ValueError(
            f"chunked log-probs need a causal LM whose logits are lm_head(decoder(x)) "
            f"(model types {', '.join(CHUNKABLE_MODEL_TYPES)}); this model is {model_type!r} "
            f"({type(model).__name__}): set learner.logit_chunk_tokens = 0"
        )
    return decoder, head


def target_logprobs(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``(log-softmax of logits at targets, logsumexp)`` over the last dimension."""
    lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, targets[..., None]).squeeze(-1) - lse, lse


def _head_chunk(head: nn.Module, hidden: Tensor, targets: Tensor) -> Tensor:
    return target_logprobs(acc(head(hidden)), targets)[0]


def decoder_hidden(decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    out = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    )
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def slices(n: int, chunks: int) -> list[tuple[int, int]]:
    return [(n * i // chunks, n * (i + 1) // chunks) for i in range(chunks)]


def chunked_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, chunks: int) -> Tensor:
    """Log-probs (as :func:`token_logprobs`, in the graph) with the vocabulary-sized work over ``chunks``
    even slices of the positions.

    The decoder runs once; the output head, the float32 logits and their log-softmax run per slice under
    activation checkpointing, so only one slice's ``[B, slice, vocab]`` tensors exist at a time in the
    forward and again in the backward (which recomputes the slice's logits). The head is called as a module
    each time, so ZeRO-3 gathers its weight as in any forward; under ZeRO-3 every rank must use the same
    ``chunks`` (the step agrees on it), since each call is a collective gather.
    """
    from torch.utils.checkpoint import checkpoint

    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    decoder, head = decoder_and_head(model)
    hidden = decoder_hidden(decoder, input_ids, attention_mask)
    logps = [
        checkpoint(_head_chunk, head, hidden[:, a:b], input_ids[:, a + 1 : b + 1], use_reentrant=False)
        for a, b in slices(input_ids.shape[1] - 1, chunks)
    ]
    return torch.cat([logps[0].new_zeros(input_ids.shape[0], 1), *logps], dim=1)
