"""Held-out evaluation: validation sets sampled at chosen policy versions, scored, recorded.

    schedule.EvalSchedule.claim(v)  the sets due at v: the first version of every `every` versions of each
        │   (shared: .due(v))       set (and version 0); one evaluation per set and bucket across every
        │                           replica and evaluator (a Redis SET NX); shared, every replica serving v
        │                           takes shards of that round (shards.ShardBoard)
    evaluator.Evaluator.begin(v, due) ─► n requests per task (sets.EvalSet: its prompts, sampling, scorer),
        │                               at most max_in_flight in the engine; a set with an environment runs
        │                               each task's n samples as one group of episodes in training's agent loop
    engine.step() ─► Evaluator.absorb(delta) ─► each response's tokens and log-probs (rounds.EvalRound)
    all generated ─► scoring thread: rounds.tally_round with the reward service's ScoringPool and scorers
        ─► (shared: each shard's tallies to Redis; the replica that hands in the round's last shard goes on)
        ─► metrics.SetResult per set (rounds.set_results) ─► metrics.EvalRecorder: Redis list
           vcpo:<run>:eval:results (the launcher writes <run_dir>/metrics.jsonl from it), gauges vcpo_eval_*,
           a log line

Where it runs (``[evaluation] placement``); build.make_evaluator builds the evaluator for each:

- **shared** (shared.py): a co-tenant of each sampler replica's engine. The replica finds it by name
  (services/sampler/cotenant.py), lends it an EngineShare and calls its hooks from its loop; a newer version
  waits for a generating round at most ``max_delay_s``. A round is split into shards among the replicas
  serving its version (shards.py), and the evaluator refuses to start where a round's worst case cannot fit
  that hold (capacity.py).
- **dedicated** (service.py, run as a Ray actor by ray_actor.py; its loop runner.EvalRunner): an engine of
  its own follows the published versions and fetches and loads only the due ones (EvalSchedule.wants);
  training never waits for it.
- **the eval command** (``deploy/eval.py`` through offline.evaluate_model): one round on a saved model, with
  no schedule.

Evaluation requests never become groups: nothing of them reaches the `rollouts` stream, the reward service
or the learner. A response is correct when its reward is at least the set's ``correct_at``; mean@n is the
mean over tasks of the fraction of a task's n samples that are correct, pass@n the fraction of tasks with at
least one correct sample.

What it uses of the sampler is the part the sampler documents as public (services/sampler/__init__.py); its
configuration is the sampler's (``[evaluation]`` in services/sampler/config.py, with ``[sampler]``'s engine
settings and ``[reward]``'s scoring settings).
"""
