"""The rank -> GPU mapping over simulated Ray layouts (no GPU needed: the mapping is pure)."""

import pytest

from orch.launchers.devices import DeviceMapping, DeviceMappingError, map_devices


def _layout(nodes: int, gpus_per_node: int, order=None) -> list[tuple[str, list[str]]]:
    """Ranks in Ray's placement order: node by node, each actor given one GPU id."""
    ids = order or list(range(gpus_per_node))
    return [(f"node{n}", [str(ids[g])]) for n in range(nodes) for g in range(gpus_per_node)]


def test_one_gpu_per_node_sees_only_its_own():
    mappings = map_devices(_layout(nodes=3, gpus_per_node=1))
    assert mappings == [DeviceMapping(cuda_visible_devices="0", local_rank=0, local_world_size=1)] * 3


def test_two_gpus_per_node_share_the_list():
    mappings = map_devices(_layout(nodes=2, gpus_per_node=2))
    assert [m.cuda_visible_devices for m in mappings] == ["0,1"] * 4
    assert [m.local_rank for m in mappings] == [0, 1, 0, 1]
    assert [m.device_index for m in mappings] == [0, 1, 0, 1]
    assert all(m.local_world_size == 2 for m in mappings)


def test_eight_gpus_handed_out_unsorted_index_the_sorted_list():
    order = [5, 2, 7, 0, 3, 1, 6, 4]
    mappings = map_devices(_layout(nodes=2, gpus_per_node=8, order=order))
    assert {m.cuda_visible_devices for m in mappings} == {"0,1,2,3,4,5,6,7"}
    # The local rank is the position of the worker's own GPU, not of the actor on its node.
    assert [m.local_rank for m in mappings] == order * 2
    assert sorted(m.local_rank for m in mappings[:8]) == list(range(8))


def test_ids_sort_numerically_not_as_text():
    mappings = map_devices([("n", ["10"]), ("n", ["2"]), ("n", ["9"])])
    assert mappings[0].cuda_visible_devices == "2,9,10"
    assert [m.local_rank for m in mappings] == [2, 0, 1]


def test_a_partial_node_sees_only_the_run_s_gpus():
    # Another job holds GPUs 0 and 1 of node a; the run got 2, 3 and 6.
    mappings = map_devices([("a", [6]), ("a", [2]), ("b", [0]), ("a", [3])])
    assert [m.cuda_visible_devices for m in mappings] == ["2,3,6", "2,3,6", "0", "2,3,6"]
    assert [m.local_rank for m in mappings] == [2, 0, 0, 1]
    assert [m.local_world_size for m in mappings] == [3, 3, 1, 3]


def test_env_names_what_deepspeed_reads():
    env = DeviceMapping(cuda_visible_devices="0,1", local_rank=1, local_world_size=2).env()
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "2"}


@pytest.mark.parametrize("gpu_ids, count", [([], 0), (["0", "1"], 2)])
def test_a_worker_without_exactly_one_gpu_is_refused(gpu_ids, count):
    with pytest.raises(DeviceMappingError, match=rf"rank 1 on node n holds {count} GPUs .*expected exactly 1.*Fix:"):
        map_devices([("n", ["0"]), ("n", gpu_ids)])


def test_fractional_gpus_sharing_one_device_are_refused():
    # Two actors with num_gpus=0.5 land on the same physical GPU.
    with pytest.raises(DeviceMappingError, match=r"node n gave GPU id\(s\) \['1'\] to more than one worker.*Fix:"):
        map_devices([("n", ["0"]), ("n", ["1"]), ("n", ["1"])])


def test_the_same_id_on_two_nodes_is_fine():
    mappings = map_devices([("a", ["0"]), ("b", ["0"])])
    assert [m.local_rank for m in mappings] == [0, 0]


def test_every_problem_is_reported_at_once():
    with pytest.raises(DeviceMappingError) as error:
        map_devices([("a", []), ("b", ["0"]), ("b", ["0"])])
    assert "rank 0 on node a" in str(error.value) and "node b gave GPU id(s) ['0']" in str(error.value)
