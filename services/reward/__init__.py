"""The reward service: scored groups out of rollout groups, by the scorer each task names.

    rollouts stream ─► loop.py (claim, score, forward atomically) ─► scored stream
                          └─► pool.ScoringPool: worker processes running scorers/ (code in common's sandbox)
    gRPC (servicer.py): Score, for callers outside the streams; serve_app.py runs the same as a Ray Serve app

Public to other packages (everything else is the service's own):

- ``config``: the ``[reward]`` table of a run file.
- ``scorers``: the scorer registry and its plugin API (``register``, ``get_scorer``, ``ScoreInput``): the
  learner's warm start measures a policy with it, and users add scorers through ``reward.plugins``.
- ``pool``: ``ScoringPool``, scoring in worker processes in-process: the evaluator scores held-out rounds with
  the run's scorers and sandbox limits through it, without a round trip to the service.

The launcher places the service through ``serve_app.deploy_reward``.
"""
