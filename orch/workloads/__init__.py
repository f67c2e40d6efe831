"""Built-in training workloads: models (a small GPT, Hugging Face causal LMs, torchvision
models), data sources (text, image, corpus and Ray Data) and objectives."""
