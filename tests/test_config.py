"""Configuration: layering, presets, and errors that name the bad key, value and source."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from deploy.config import SystemConfig
from services.common.config import (
    ConfigError,
    RunConfig,
    add_config_arguments,
    config_from_args,
    load_config,
    parse_literal,
    write_resolved,
)
from services.learner.config import LearnerServiceConfig
from services.reward.config import RewardServiceConfig
from services.sampler.config import SamplerServiceConfig
from services.weight_broker.config import WeightBrokerServiceConfig

PRESETS = sorted((Path(__file__).parent.parent / "deploy" / "presets").glob("*.toml"))
SERVICE_MODELS = [SamplerServiceConfig, LearnerServiceConfig, RewardServiceConfig, WeightBrokerServiceConfig]


def test_presets_exist() -> None:
    names = {p.stem for p in PRESETS}
    assert {"local", "qwen2.5-1.5b-gsm8k", "qwen2.5-7b-math"} <= names


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_parses_for_the_system_and_every_service(preset: Path) -> None:
    system = load_config(SystemConfig, [preset], env={})
    for model in SERVICE_MODELS:
        service = load_config(model, [preset], env={})
        assert service.run == system.run  # the shared section reads the same in every service
        assert service.streams == system.streams


@pytest.mark.parametrize("preset", [p for p in PRESETS if p.stem != "local"], ids=lambda p: p.stem)
def test_gpu_presets_give_every_sampler_replica_its_gpus(preset: Path) -> None:
    cfg = load_config(SystemConfig, [preset], env={})
    assert cfg.learner.gpus_per_rank > 0
    assert cfg.sampler.gpus_per_replica >= cfg.sampler.tensor_parallel_size


def test_sampler_gpus_are_checked_against_the_learner_and_tensor_parallelism() -> None:
    with pytest.raises(ValueError, match=r"sampler\.gpus_per_replica = 0 while learner\.gpus_per_rank = 1"):
        SystemConfig.model_validate({"learner": {"gpus_per_rank": 1}})
    with pytest.raises(
        ValueError, match=r"gpus_per_replica = 1 is less than sampler\.tensor_parallel_size = 2"
    ):
        SystemConfig.model_validate({"sampler": {"tensor_parallel_size": 2, "gpus_per_replica": 1}})
    # shares of a GPU are fine for one-GPU engines, whose vLLM then takes at most that share of its memory
    # (vLLM 0.32 asks for gpu_memory_utilization of the whole GPU free at start-up); CPU runs reserve none
    half = {"gpus_per_replica": 0.5, "gpu_memory_utilization": 0.45}
    SystemConfig.model_validate({"sampler": half, "learner": {"gpus_per_rank": 1}})
    with pytest.raises(
        ValueError,
        match=r"gpu_memory_utilization = 0\.9 with sampler\.gpus_per_replica = 0\.5: .*at most 0\.45",
    ):
        SystemConfig.model_validate({"sampler": {"gpus_per_replica": 0.5}, "learner": {"gpus_per_rank": 1}})
    with pytest.raises(ValueError, match=r"at most 0\.2 "):
        SystemConfig.model_validate({"sampler": {"gpus_per_replica": 0.25, "gpu_memory_utilization": 0.21}})
    SystemConfig.model_validate({"sampler": {"tensor_parallel_size": 2, "gpus_per_replica": 2}})
    SystemConfig.model_validate({})


def test_paper_preset_has_the_paper_hyperparameters() -> None:
    cfg = load_config(SystemConfig, [p for p in PRESETS if p.stem == "qwen2.5-7b-math"], env={})
    assert (cfg.learner.lr, cfg.sampler.n, cfg.run.groups_per_step) == (1e-6, 16, 32)
    assert (cfg.learner.truncation, cfg.learner.rho_base, cfg.sampler.max_tokens) == (8.0, 1.0, 2048)


def test_simpletir_preset_runs_its_dataset_in_the_builtin_python_environment() -> None:
    from services.sampler.environments.registry import validate_spec
    from vcpo.v1 import registry_pb2

    cfg = load_config(SystemConfig, [p for p in PRESETS if p.stem == "qwen2.5-7b-simpletir"], env={})
    # the paper's multi-turn setting
    assert (cfg.run.k, cfg.learner.rho_base, cfg.learner.lr) == (2, 0.55, 1e-6)
    (env,) = cfg.sampler.environments
    assert cfg.sampler.dataset_environment == env.name == "python"
    spec = validate_spec(registry_pb2.EnvironmentSpec(**env.model_dump(exclude_defaults=True)), cfg.sampler.n)
    assert (spec.builtin, spec.tool_parser, spec.scorer) == ("python", "fenced_code", "math")
    assert spec.max_turns == 5


def test_layers_defaults_then_files_then_env_then_cli(tmp_path: Path) -> None:
    a = tmp_path / "a.toml"
    b = tmp_path / "b.toml"
    a.write_text('[run]\nk = 3\ngroups_per_step = 5\nrun_id = "from-a"\n[sampler]\ntop_p = 0.5\n')
    b.write_text("[run]\nk = 7\n")
    assert load_config(SamplerServiceConfig, env={}).run.k == RunConfig().k  # defaults
    cfg = load_config(SamplerServiceConfig, [a, b], env={})
    assert (cfg.run.k, cfg.run.groups_per_step, cfg.run.run_id, cfg.sampler.top_p) == (7, 5, "from-a", 0.5)
    env = {"VCPO_RUN__K": "9", "VCPO_SAMPLER__TEMPERATURE": "0.7", "VCPO_TARGET": "cpu", "PATH": "/bin"}
    cfg = load_config(SamplerServiceConfig, [a, b], env=env)
    assert (cfg.run.k, cfg.sampler.temperature) == (9, 0.7)
    cfg = load_config(SamplerServiceConfig, [a, b], env=env, overrides=[("run.k", 11, "cli")])
    assert (cfg.run.k, cfg.run.groups_per_step, cfg.sampler.temperature) == (11, 5, 0.7)


def test_cli_flags_and_set(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, LearnerServiceConfig)
    args = parser.parse_args(["--run.k", "16", "--set", "learner.betas=[0.8, 0.9]", "--learner.lr", "3e-6"])
    cfg = config_from_args(LearnerServiceConfig, args, env={"VCPO_RUN__K": "2"})
    assert (cfg.run.k, cfg.learner.betas, cfg.learner.lr) == (16, (0.8, 0.9), 3e-6)
    help_text = parser.format_help()
    assert "--run.k" in help_text and "Maximum policy lag" in help_text


def test_parse_literal() -> None:
    assert parse_literal("16") == 16
    assert parse_literal("1e-6") == 1e-6
    assert parse_literal("true") is True
    assert parse_literal("[1, 2]") == [1, 2]
    assert parse_literal("runs/x") == "runs/x"
    assert parse_literal("Qwen/Qwen2.5-7B") == "Qwen/Qwen2.5-7B"


@pytest.mark.parametrize(
    ("toml", "env", "expected"),
    [
        ("[run]\nk = -1\n", {}, "run.k = -1 (from {file}): Input should be greater than or equal to 0"),
        ("", {"VCPO_RUN__K": "-2"}, "run.k = -2 (from env VCPO_RUN__K)"),
        (
            "[sampler]\ntop_p = 1.5\n",
            {},
            "sampler.top_p = 1.5 (from {file}): Input should be less than or equal to 1",
        ),
        ("[sampler]\ntemprature = 0.5\n", {}, "unknown key 'sampler.temprature' (from {file})"),
        (
            '[run]\nrun_id = "bad id!"\n',
            {},
            'run.run_id = "bad id!" (from {file}): String should match pattern',
        ),
        ('[sampler]\nweight_update = "sometimes"\n', {}, 'sampler.weight_update = "sometimes"'),
        (
            "[learner]\nbetas = [0.9, 1.5]\n",
            {},
            "learner.betas = [0.9, 1.5] (from {file}): Value error, each beta",
        ),
        (
            "[reward]\nmin_replicas = 4\nmax_replicas = 2\n",
            {},
            "max_replicas (2) must be >= min_replicas (4)",
        ),
        (
            "[learner]\nnum_ranks = 2\ngpus_per_rank = 0.5\n",
            {},
            "learner.gpus_per_rank = 0.5 with learner.num_ranks = 2: ranks would share a GPU",
        ),
        (
            '[learner]\nnum_ranks = 2\nobjective = "reinforce"\n',
            {},
            "learner.objective = 'reinforce' with learner.num_ranks = 2: its baseline is the mean reward over "
            "the step's batch",
        ),
        ("[smapler]\nn = 2\n", {}, "unknown section 'smapler' (from {file})"),
        (
            "",
            {"VCPO_SAMPLER__N": "many"},
            'sampler.n = "many" (from env VCPO_SAMPLER__N): Input should be a valid integer',
        ),
    ],
)
def test_bad_values_fail_with_a_message_naming_them(
    tmp_path: Path, toml: str, env: dict[str, str], expected: str
) -> None:
    f = tmp_path / "run.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(SystemConfig, [f], env=env)
    assert expected.format(file=f) in str(info.value)


def test_every_service_model_reports_bad_values_too(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text("[run]\ngroups_per_step = 0\n")
    for model in SERVICE_MODELS:
        with pytest.raises(ConfigError, match=r"run.groups_per_step = 0 \(from .*run.toml\)"):
            load_config(model, [f], env={})


def test_missing_and_broken_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file not found: .*nope.toml"):
        load_config(SystemConfig, [tmp_path / "nope.toml"], env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nk=1")
    with pytest.raises(ConfigError, match=r"bad.toml is not valid TOML"):
        load_config(SystemConfig, [bad], env={})
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, SamplerServiceConfig)
    with pytest.raises(ConfigError, match=r"--set expects KEY=VALUE, got 'run.k'"):
        config_from_args(SamplerServiceConfig, parser.parse_args(["--set", "run.k"]), env={})


def test_resolved_config_is_written_as_json(tmp_path: Path) -> None:
    cfg = load_config(SystemConfig, [p for p in PRESETS if p.stem == "local"], env={})
    path = write_resolved(cfg, tmp_path / "run")
    data = json.loads(path.read_text())
    assert data["run"]["k"] == 4 and data["learner"]["objective"] == "vcpo"
    assert SystemConfig.model_validate(data) == cfg  # the resolved file is itself a valid config
    assert load_config(SystemConfig, [path], env={}) == cfg  # and what the launcher hands every service
    assert load_config(SamplerServiceConfig, [path], env={}).run == cfg.run
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ConfigError, match=r"broken.json is not valid JSON"):
        load_config(SystemConfig, [broken], env={})


def modules_imported_by(code: str, watched: tuple[str, ...], cwd: Path | None = None) -> str:
    """Which of ``watched`` a fresh interpreter holds after running ``code``, comma-separated ("" for none);
    ``code`` may also print names of its own first (on the same line, ending with a comma)."""
    import subprocess
    import sys

    probe = f"{code}\nimport sys\nprint(','.join(m for m in {watched!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=cwd)
    return out.stdout.strip()


def test_config_modules_import_nothing_heavy() -> None:
    code = "import deploy.config, services.common.config"
    assert modules_imported_by(code, ("torch", "vllm", "deepspeed", "ray", "transformers")) == ""


def test_placement_settings_default_to_the_single_machine_behaviour() -> None:
    """The keys the Helm chart sets to pin each service to its pods (ray_resources) and to give every replica
    the same ports (one per pod) keep the local run's behaviour when absent."""
    cfg = load_config(SystemConfig, [], env={})
    assert cfg.sampler.port_per_replica is True and cfg.reward.serve_ports == "free"
    for section in (cfg.sampler, cfg.learner, cfg.reward, cfg.weight_broker):
        assert section.ray_resources == {}
    cfg = load_config(
        SystemConfig,
        [],
        env={"VCPO_SAMPLER__RAY_RESOURCES": "{vcpo_sampler = 1}", "VCPO_REWARD__SERVE_PORTS": "configured"},
    )
    assert cfg.sampler.ray_resources == {"vcpo_sampler": 1.0} and cfg.reward.serve_ports == "configured"
    with pytest.raises(ConfigError, match=r"learner\.ray_resources\.vcpo_learner = -1 .*greater than 0"):
        load_config(SystemConfig, [], env={"VCPO_LEARNER__RAY_RESOURCES": "{vcpo_learner = -1}"})


def test_the_services_default_ports_differ() -> None:
    """Services that share a node (a bare Ray cluster, or each started by hand on one machine) bind their
    default ports side by side: no two may be the same (the broker's data plane once took the reward's)."""
    cfg = SystemConfig()
    owners: dict[int, list[str]] = {}
    for section in ("sampler", "learner", "reward", "weight_broker", "launcher", "evaluation"):
        for name, value in getattr(cfg, section).model_dump().items():
            if name.endswith("_port") and value:
                owners.setdefault(value, []).append(f"{section}.{name}")
    assert {port: names for port, names in owners.items() if len(names) > 1} == {}
    assert len(owners) >= 10, owners  # every service's gRPC and metrics ports, the broker's data port


# --------------------------------------------------------------- the paper's data and the released settings

PAPER = {"qwen2.5-1.5b-gsm8k": "gsm8k", "qwen2.5-7b-math": "math", "qwen2.5-7b-simpletir": "multiturn"}
PRESET_DIR = Path(__file__).parent.parent / "deploy" / "presets"
UPDATE_FIELDS = (
    "objective",
    "importance_weighting",
    "truncation",
    "ess_rule",
    "rho_base",
    "baseline_weighting",
    "loss_aggregation",
    "std_normalize",
    "ppo_clip",
    "lr",
    "weight_decay",
    "grad_clip",
    "betas",
)


@pytest.mark.parametrize("preset", sorted(PAPER))
def test_paper_presets_read_the_published_files_as_downloaded(preset: str, tmp_path: Path) -> None:
    """The paper presets name the published files (veRL layout) and score each row as the authors' code: the
    same presets with their paths pointed at small files in that layout load every set, each task scored by
    the rule its data_source picks."""
    pytest.importorskip("pyarrow.parquet")
    from services.common.datasets import load_dataset
    from services.reward.scorers.verl_rules import VERL_SCORERS
    from tests.verl_layout import gsm8k_rows, math_rows, write_parquet

    cfg = load_config(SystemConfig, [PRESET_DIR / f"{preset}.toml"], env={})
    s = cfg.sampler
    assert (s.prompt_field, s.answer_field, s.source_field) == (
        "prompt",
        "reward_model.ground_truth",
        "data_source",
    )
    assert s.scorer_by_source == VERL_SCORERS
    paths = [s.dataset] + [spec.dataset for spec in cfg.evaluation.sets]
    assert all(p.startswith("/data/vcpo/") and p.endswith(".parquet") for p in paths), paths
    rows = (
        gsm8k_rows()
        if "gsm8k" in preset
        else [
            dict(r, data_source=src)
            for r, src in zip(math_rows(3), ["math-500", "dapo_filter", "aime25"], strict=True)
        ]
    )
    expected = {
        "openai/gsm8k": "gsm8k",
        "math-500": "math_verl",
        "dapo_filter": "math_verl",
        "aime25": "math_dapo",
    }
    for path in paths:
        local = write_parquet(tmp_path / path.removeprefix("/data/vcpo/"), rows)
        tasks = load_dataset(
            str(local),
            s.prompt_field,
            s.answer_field,
            scorer_by_source=s.scorer_by_source,
            source_field=s.source_field,
        )
        assert [t.scorer for t in tasks] == [expected[r["data_source"]] for r in rows]
        assert [t.reference for t in tasks] == [r["reward_model"]["ground_truth"] for r in rows]
        assert all(t.messages and not t.prompt for t in tasks)


@pytest.mark.parametrize("preset", sorted(PAPER))
def test_released_settings_differ_from_the_paper_form_in_the_baseline_weighting_only(preset: str) -> None:
    """deploy/presets/released/<task>.toml on its paper preset: the released scripts' lag, batch and update
    (mit-han-lab/vcpo recipe/fully_async_policy/shell/vcpo/<task>/vcpo_k=*.sh); of the update's settings only
    the OPOB weighting differs from the paper form."""
    paper = load_config(SystemConfig, [PRESET_DIR / f"{preset}.toml"], env={})
    released = load_config(
        SystemConfig,
        [PRESET_DIR / f"{preset}.toml", PRESET_DIR / "released" / f"{PAPER[preset]}.toml"],
        env={},
    )
    differ = [f for f in UPDATE_FIELDS if getattr(paper.learner, f) != getattr(released.learner, f)]
    assert differ == ["baseline_weighting"]
    assert (paper.learner.baseline_weighting, released.learner.baseline_weighting) == ("paper", "released")
    lr = released.learner
    assert (lr.objective, lr.importance_weighting, lr.truncation, lr.ess_rule) == (
        "vcpo",
        "truncated",
        8.0,
        "sqrt",
    )
    assert (lr.loss_aggregation, lr.std_normalize, lr.ppo_clip) == ("seq-mean-token-mean", True, 0.0)
    assert (lr.lr, lr.weight_decay, lr.grad_clip) == (1e-6, 0.1, 1.0)
    script = {  # k, prompts per step, rollout.n, base ESS ratio, model (from the released scripts)
        "gsm8k": (12, 8, 8, 1.0, "Qwen/Qwen2-1.5B"),
        "math": (10, 32, 16, 1.0, "Qwen/Qwen2.5-7B"),
        "multiturn": (2, 128, 16, 0.55, "Qwen/Qwen2.5-7B"),
    }[PAPER[preset]]
    r = released
    assert (r.run.k, r.run.groups_per_step, r.sampler.n, lr.rho_base, r.run.model) == script


def test_a_learner_started_on_its_own_is_checked_like_a_whole_run() -> None:
    """``python -m services.learner`` reads only its sections: the checks that concern them hold there too
    (a rank left without a group raised while the others waited for it in a collective)."""
    from services.learner.config import LearnerServiceConfig

    with pytest.raises(ValueError, match=r"run\.groups_per_step = 1 is less than learner\.num_ranks = 2"):
        LearnerServiceConfig.model_validate({"run": {"groups_per_step": 1}, "learner": {"num_ranks": 2}})
    with pytest.raises(ValueError, match=r"objective = 'reinforce' with learner\.num_ranks = 2"):
        LearnerServiceConfig.model_validate({"learner": {"num_ranks": 2, "objective": "reinforce"}})
    LearnerServiceConfig.model_validate({"learner": {"num_ranks": 1, "objective": "reinforce"}})
    LearnerServiceConfig.model_validate({"run": {"groups_per_step": 2}, "learner": {"num_ranks": 2}})
    with pytest.raises(ValueError, match=r'set weight_broker\.transport = "tcp"'):
        LearnerServiceConfig.model_validate(
            {"learner": {"lora": {"rank": 8}}, "weight_broker": {"transport": "collective"}}
        )
