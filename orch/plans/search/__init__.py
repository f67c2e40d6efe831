"""The tuner's search: every plan of a world size and global batch, pruned and ranked."""
