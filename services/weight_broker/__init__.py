"""The weight broker: how policy versions travel from the learner to the samplers.

The package holds two sides. The client side is what the learner, the samplers and the launcher import; the
server side is the broker's process, which only the broker's own entry points, its tests and its benchmarks
import. Client-side and shared modules never import a server module, so a sampler or the learner loads none
of the broker's server (its gRPC servicer, data-plane server, metrics, seat in the weight group).

Client side (other services may import these):

- ``config``: the ``[weight_broker]`` table of a run file.
- ``transports/``: the ``WeightTransport`` interface, its ``tcp`` transport (the broker's client) and
  ``transport_from_config``.
- ``follower``: a sampler's loop that notices newer versions and loads each whole.
- ``weight_group``: the collective transport's process group: its spec, forming, announcements, failure.
- ``nccl_group``: its NCCL process group, and the setting that keeps a process alive after its failure.
- ``collective``: what travels over the weight group, and rank 0's publisher and its staging buffer.
- ``receiver``: the receivers (each engine worker) of what the publisher sends, and the thread
  a worker receives on while its engine generates.
- ``buckets``: how a version is cut for the weight group (buckets and the pieces they travel in).
- ``members``: who the weight group's members are (their GPUs), as every rank reads it.
- ``seats``: the weight group's receivers in its control plane (their registration in Redis, their seat in an
  epoch).
- ``group_control``: the weight group's control plane on learner rank 0 (the coordinator that forms epochs).

Shared by both sides (the client side and the broker agree through these):

- ``tensors``: tensors as bytes, checksums, manifests, the safetensors layout.
- ``wire``: chunk messages encoded and decoded without protobuf's copies.
- ``protocol``: the publish and fetch streams as plain functions, both halves.
- ``store``: the broker's versioned storage (memory, disk), and the refusals the transport raises.
- ``dataplane``: the TCP data plane's frames and the client's two calls.

Server side (the broker's process; nothing outside the broker imports these, except
``ray_actor.start_broker``, which the Ray launcher calls to place the broker):

- ``servicer``: the gRPC service and the broker's metrics.
- ``announce``: announcements of committed versions on the run's ``weights`` stream.
- ``dataplane_server``: the TCP data plane's server, over the servicer.
- ``service``: the broker wired (store, servicer, servers, announcements); ``main``, ``__main__`` and
  ``ray_actor`` start it as a process or a Ray actor.
"""
