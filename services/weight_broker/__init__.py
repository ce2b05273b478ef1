"""The weight broker's service: it keeps the retained policy versions and serves them to samplers that were not
in the weight group for a version (late joiners, restarts, versions published while the group formed), and
announces each one it commits. What it stores and speaks (the version store, the publish and fetch protocols,
the TCP data plane's frames) is the weight transport library, ``services/weight_transport/``, which the learner
and the samplers use too; nothing outside the broker imports this package, except the launcher, which starts it
(``ray_actor.start_broker``).

- ``config``: what the broker's process reads (the shared sections and ``[weight_broker]``).
- ``servicer``: the gRPC service (latest, list, status), the publishes and fetches the data plane hands it, the
  broker's metrics, and announcements of committed versions on the run's ``weights`` stream.
- ``dataplane_server``: the TCP data plane's server, over the servicer.
- ``service``: the broker wired (store, servicer, servers, announcements) and its process's ``main``
  (``__main__``); ``ray_actor`` starts it as a Ray actor.
"""
