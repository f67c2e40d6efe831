"""The planner: what a plan is, whether it fits and how fast it runs. Knows nothing of Ray or Hydra.

- here: the declared schemas (``spec``), their range checks (``validate``), resolution against the
  cluster (``resolve``), the live cluster's facts (``cluster_facts``), the settings a resolved plan
  implies (``engine_settings``, ``optim_settings``) and the errors every part raises;
- ``model/``: the model built on ``meta`` and the workload around it;
- ``parallel/``: the rank grid, pipeline stages and tensor-parallel layer specs;
- ``memory/``: per-rank and per-node memory, the estimate and its fixes;
- ``step_time/``: FLOPs, shapes and traffic, the cost model and its prediction;
- ``search/``: the tuner's search over plans;
- ``engines/``: one spec per training engine, asked by name (``engine_spec(plan.engine)``);
- ``storage/``: paths and URIs of checkpoints and data.
"""
