"""Validation sets: the run's ``[[evaluation.sets]]`` loaded with the training readers and encoded with its
chat template, each with the scorer and sampling settings it is evaluated under."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.datasets import load_dataset
from services.common.prompts import PromptEncoder, TaskError
from services.sampler.config import SamplerServiceConfig, eval_set_environment
from services.sampler.engine import Sampling
from vcpo.v1 import rollout_pb2


@dataclass
class EvalSet:
    """A validation set ready to sample: its tasks, their prompt tokens, its scorer and sampling settings."""

    name: str
    tasks: list[rollout_pb2.Task]
    prompts: list[list[int]]
    scorer: str  # for tasks that name no scorer of their own ("": decided per response, see scorer_of)
    n: int
    sampling: Sampling
    correct_at: float = 1.0
    environment: str = ""  # each task's n samples run as one group of episodes in this environment
    # reward.default_scorer: for an episode that names no scorer and that its environment gave no reward
    default_scorer: str = "exact_match"

    def scorer_of(self, task: rollout_pb2.Task, environment_reward: float | None) -> str:
        """As the reward service picks one for training groups: the task's own, the set's (or its
        environment's), the environment's reward when it gave one, else reward.default_scorer."""
        if task.scorer or self.scorer:
            return task.scorer or self.scorer
        return "environment" if environment_reward is not None else self.default_scorer


def load_eval_sets(cfg: SamplerServiceConfig, encoder: PromptEncoder) -> list[EvalSet]:
    """The run's ``[[evaluation.sets]]``, loaded with the training readers and encoded with its chat template.
    A set that cannot be loaded, is empty or holds a task that cannot be sampled is a ValueError naming it."""
    s = cfg.sampler
    out = []
    for spec in cfg.evaluation.sets:
        environment = eval_set_environment(s, spec)
        prompt_field, answer_field = spec.prompt_field or s.prompt_field, spec.answer_field or s.answer_field
        try:
            # a set's own scorer judges all its tasks; else each task's from sampler.scorer_by_source
            by_source = {} if spec.scorer else s.scorer_by_source
            tasks = load_dataset(
                spec.dataset,
                prompt_field,
                answer_field,
                split=spec.split,
                seed=cfg.run.seed,
                scorer_by_source=by_source,
                source_field=s.source_field,
            )
            tasks = tasks[: spec.limit] if spec.limit else tasks
            prompts = [encoder.encode(task) for task in tasks]
        except (TaskError, ValueError) as exc:
            raise ValueError(f"evaluation set {spec.name!r}: {exc}") from exc
        if not tasks:
            raise ValueError(f"evaluation set {spec.name!r}: {spec.dataset!r} has no tasks")
        greedy = spec.temperature == 0
        sampling = Sampling(
            temperature=spec.temperature,
            top_p=1.0 if greedy else spec.top_p,
            max_tokens=spec.max_tokens or s.max_tokens,
            stop=tuple(s.stop),
        )
        if environment is not None:
            for task in tasks:
                task.environment = environment.name
            scorer = spec.scorer or environment.scorer  # "": per episode
        else:
            scorer = spec.scorer or cfg.reward.default_scorer
        out.append(
            EvalSet(
                spec.name,
                tasks,
                prompts,
                scorer,
                spec.n,
                sampling,
                spec.correct_at,
                spec.environment,
                cfg.reward.default_scorer,
            )
        )
    return out
