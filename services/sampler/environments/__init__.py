"""Tool-use environments the sampler runs multi-turn episodes against.

    EnvironmentSpec (registered over gRPC, kept in Redis) ─► make_environment(spec)
        ├─ endpoint "host:port" ─► GrpcEnvironment: a user's server of ``vcpo.v1.Environment``, any language
        └─ builtin "python"     ─► PythonEnvironment: runs the model's code in the reward service's sandbox
    ToolParser (spec.tool_parser) ─► finds a complete tool call in a turn's text; formats observations

Everything here speaks the protocol's own messages (``environment_pb2``), so an in-process built-in and a
remote server are interchangeable, and :func:`serve_environment` serves any :class:`Environment` over gRPC.
"""
