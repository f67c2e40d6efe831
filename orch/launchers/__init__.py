"""Ray worker group and the training workers, which train through an engine (DeepSpeed or
FSDP2, in engines/). Knows nothing of Hydra: takes resolved plans."""
