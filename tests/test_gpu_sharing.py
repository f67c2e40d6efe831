"""The worker group's GPU gathering, in real Ray actors on a node that declares logical GPUs.

Ray hands out GPU ids from a node's declared ``num_gpus`` whether or not the devices exist, so
the gathering and the hand-out run here exactly as on a GPU node; only ``setup`` (which would
call ``torch.cuda.set_device``) is not run.
"""

from __future__ import annotations

import os

import pytest
import ray

from helpers.config import REPO
from helpers.ray_cluster import release_shared_ray
from orch.launchers.gpu_sharing import share_gpus
from orch.launchers.placement import assign_ranks
from orch.launchers.worker import TrainWorker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_with_4_logical_gpus():
    from orch.launchers.ray_session import start_local_ray

    release_shared_ray()  # a Ray of its own: other resources

    start_local_ray(num_cpus=2, num_gpus=4, object_store_memory=200 * 1024**2,
                    runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}})
    yield
    ray.shutdown()


def test_four_workers_on_one_node_share_all_four_gpus(ray_with_4_logical_gpus):
    actors = [ray.remote(TrainWorker).options(num_cpus=0, num_gpus=1).remote() for _ in range(4)]
    try:
        reported = ray.get([actor.accelerator_ids.remote() for actor in actors])
        own = [gpu_ids[0] for _, gpu_ids in reported]
        assert sorted(own, key=int) == ["0", "1", "2", "3"]
        slots = share_gpus(actors, assign_ranks([node for node, _ in reported]))
        # LOCAL_RANK is the index of the actor's own GPU in "0,1,2,3", whatever order Ray used.
        assert [slot.local_rank for slot in slots] == [int(gpu) for gpu in own]
        assert {slot.local_world_size for slot in slots} == {4}
        mappings = ray.get([actor.__ray_call__.remote(lambda worker: worker.device_mapping) for actor in actors])
        assert {m.cuda_visible_devices for m in mappings} == {"0,1,2,3"}
        assert [m.device_index for m in mappings] == [int(gpu) for gpu in own]
    finally:
        for actor in actors:
            ray.kill(actor)
