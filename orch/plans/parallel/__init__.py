"""How a plan splits the model and the ranks: the dp x pp x tp rank grid, the pipeline's stages and
bubble, the tensor-parallel layer specs, and the engine-neutral description of pipeline stages."""
