"""Built-in training workloads: a small GPT and a byte-level text corpus."""
