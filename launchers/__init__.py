"""Ray worker group and DeepSpeed workers. Knows nothing of Hydra: takes resolved plans."""
