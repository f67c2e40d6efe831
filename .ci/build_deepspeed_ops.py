"""Build one of DeepSpeed's JIT C++ ops for the CPU accelerator into torch's extension cache.

DeepSpeed compiles an op the first time a process loads it (CPU Adam about 60 s, the
shared-memory all-reduce about 30 s on 2 cores) and caches it under ~/.cache/torch_extensions.
On a fresh CI machine the first test to load each op would pay that inside the suite; built here,
while pip installs the rest of the dependencies, it overlaps with the install instead. The tests
load the cached op, or build it themselves if this failed.

    DS_ACCELERATOR=cpu python .ci/build_deepspeed_ops.py CPUAdamBuilder
"""

import sys

from deepspeed.accelerator import get_accelerator

if __name__ == "__main__":
    get_accelerator().create_op_builder(sys.argv[1]).load()
