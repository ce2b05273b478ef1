"""The learner: scored groups in, a new policy version out per optimizer step (DeepSpeed ZeRO-3, VCPO).

    scored stream ─► feed.py ─► batching.py ─► service.LearnerRank.step: step.py (gradients) over vcpo.py
    (the loss; objectives/ one module per objective) ─► trainer.py (ZeRO-3 optimizer step, checkpoints)
    ─► publish.py (weights to the broker or the weight group)

Public to other packages: ``config`` (the ``[learner]`` table) alone. The launcher places the ranks through
``ray_group.LearnerGroup`` (or ``python -m services.learner``, supervisor.py); everything else is the
learner's own, and its math (vcpo.py, objectives/, ess.py, step.py) is pure: tensors in, loss and metrics
out.
"""
