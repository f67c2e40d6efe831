"""Storage locations: what a path or URI says, and opening one within a time limit."""
