"""orch: declarative distributed training. One installed package, its parts as sub-packages:

- ``orch.plans``: the planner (plan specs and validation, memory, step time, the tuner's search);
  pure, no Ray, Hydra or MLflow;
- ``orch.launchers``: the Ray workers and the engines behind one seam (DeepSpeed, FSDP2);
- ``orch.workloads``: the shipped models, objectives and data (the only part that knows a
  language model or an image classifier);
- ``orch.conf``: the shipped Hydra configs;
- the CLI and the glue between them: ``orch.cli``, ``orch.run`` (`orch train`'s driver),
  ``orch.tune``, ``orch.tracking`` and the checks the commands share.

One top-level name, so that a user's own ``plans/``, ``workloads/`` or ``launchers/`` package in
the working directory (which Ray puts first on the workers' import path) never replaces ours.
"""
