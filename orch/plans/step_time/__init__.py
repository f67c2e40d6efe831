"""How long a plan's optimizer step takes: the model's FLOPs, matmul shapes and memory traffic counted
on ``meta``, the cost model (compute, bubble, communication, offload) and the prediction the tuner
and `orch check` share."""
