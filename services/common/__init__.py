"""Code several services share; no module here imports a service.

Config and run files (config.py), the streams (streams/) and the admission counter, metrics and health
(observability.py), a local Redis, the tiny model and model directories (tiny_model.py, model_dirs.py),
datasets, builtin task sets and prompt encoding (datasets.py, builtin_datasets.py, prompts.py), the code
sandbox (sandbox.py), synthetic stream messages for load and tests (synthetic.py).
"""
