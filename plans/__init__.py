"""The planner: plan schemas, validation and resolution. Knows nothing of Ray or Hydra."""
