"""The model as the planner sees it: built on ``meta`` (shapes, no storage), its parameters,
depth and attention kernel read off it, and the workload (model, inputs, objective) every layer takes."""
