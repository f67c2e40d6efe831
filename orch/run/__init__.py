"""`orch train`: one training job run from the command line. The driver checks it, tracks it and
trains it (driver), its start-up overlapped step by step (startup; the embedded Ray started before
torch is imported: early_ray), its checkpoint directory held and its model signed (resume), its
progress shown (progress).

Nothing is imported here: `orch train` imports ``startup`` (and ``early_ray`` with it) before torch,
and this package with them.
"""
