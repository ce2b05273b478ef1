"""The sampler: tasks in, rollout groups with exact behaviour log-probs out (service.py wires a replica).

Public to other packages (the evaluator builds on these; everything else is the sampler's own):

- config.py: ``SamplerServiceConfig`` and the sections it reads, ``[evaluation]`` included (evaluation runs
  on engines with the sampler's settings);
- engine.py: the step-engine interface (``GenerationEngine``, ``Sampling``, ``TokenDelta``);
- build.py: ``make_engine`` and ``environment_registry``, the engine and environment registry with the
  sampler's settings;
- agent.py, groups.py: the agent loop that runs a task's n samples as episodes in an engine (``AgentLoop``,
  ``Group``);
- weights.py: ``WeightSync``, following the published versions into an engine;
- cotenant.py: ``Cotenant`` and ``EngineShare``, how a replica shares its engine (held-out evaluation with
  ``placement = "shared"``): the only way the loop reaches a co-tenant.
"""

import os

# before anything asks torch whether CUDA is there: torch's default check initializes the CUDA driver, and a
# vLLM engine then forks its engine core and workers (fork is vLLM's default outside Ray), which fail with a
# CUDA initialization error. vLLM sets this on import, too late when the replica asked first (its member
# registration, the engine's own check). NVML answers without initializing CUDA.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
