"""The weight broker's service: it keeps the retained policy versions, serves them to samplers the weight group
did not give them to (late joiners, restarts, versions published while the group formed) and announces each one
it commits. What it stores and speaks is the weight transport library (``services/weight_transport/``); nothing
outside this package imports it except the launcher (``ray_actor.start_broker``). Design:
docs/design/weight-transport.md, "The weight broker".
"""
