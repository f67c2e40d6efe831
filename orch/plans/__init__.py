"""The planner: plan schemas, validation and resolution, per-device memory and step-time
prediction for DeepSpeed and FSDP2 plans, and the search over plans. Knows nothing of Ray or Hydra."""
