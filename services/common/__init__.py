"""Code several services share: config, streams, admission, metrics/health, local Redis, tiny model."""
