"""bf16 GEMMs and convolutions computed in fp32 on CPUs without bf16 instructions
(orch/launchers/cpu_bf16.py): the same numbers as a bf16 kernel, forward and backward."""

from __future__ import annotations

import pytest
import torch

from orch.launchers import cpu_bf16
from orch.launchers.cpu_bf16 import bf16_in_fp32, widens_bf16

BF16 = torch.bfloat16


@pytest.fixture
def widening(monkeypatch):
    """The fp32 path, whatever this machine's CPU has."""
    monkeypatch.setattr(cpu_bf16, "cpu_has_bf16_kernels", lambda: False)


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.float().to(BF16)


def test_gemms_give_the_fp32_result_rounded_once_to_bf16(widening):
    torch.manual_seed(0)
    a, b, bias = (torch.randn(17, 33, dtype=BF16), torch.randn(33, 9, dtype=BF16), torch.randn(9, dtype=BF16))
    x, y = torch.randn(3, 5, 33, dtype=BF16), torch.randn(3, 33, 7, dtype=BF16)
    with bf16_in_fp32("bf16", torch.device("cpu")):
        mm, addmm, bmm = a @ b, torch.addmm(bias, a, b, beta=0.5, alpha=2.0), torch.bmm(x, y)
        linear = torch.nn.functional.linear(a, b.t(), bias)
    assert mm.dtype == addmm.dtype == bmm.dtype == linear.dtype == BF16
    assert torch.equal(mm, (a.float() @ b.float()).to(BF16))
    assert torch.equal(addmm, (0.5 * bias.float() + 2.0 * (a.float() @ b.float())).to(BF16))
    assert torch.equal(bmm, torch.bmm(x.float(), y.float()).to(BF16))
    assert torch.equal(linear, (a.float() @ b.float() + bias.float()).to(BF16))
    # torch's own bf16 kernel accumulates in fp32 too: the same up to the order of the additions.
    torch.testing.assert_close(mm, a @ b, rtol=2**-7, atol=1e-2)


def test_a_training_step_gets_the_gradients_of_a_bf16_step(widening):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 4)).to(BF16)
    images = torch.randn(2, 3, 6, 6, dtype=BF16)

    def grads(widen: bool) -> list[torch.Tensor]:
        model.zero_grad()
        with bf16_in_fp32("bf16" if widen else "fp32", torch.device("cpu")):
            model(images).float().square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    widened, native = grads(True), grads(False)
    assert all(g.dtype == BF16 for g in widened)
    for w, n in zip(widened, native, strict=True):
        torch.testing.assert_close(w, n, rtol=2e-2, atol=2e-2)


def test_mixed_dtypes_still_fail_as_torch_fails_them(widening):
    with bf16_in_fp32("bf16", torch.device("cpu")), pytest.raises(RuntimeError, match="dtype"):
        torch.randn(2, 3, dtype=BF16) @ torch.randn(3, 2)


def test_the_path_is_taken_only_for_bf16_on_a_cpu_without_its_instructions(monkeypatch):
    for native in (False, True):
        monkeypatch.setattr(cpu_bf16, "cpu_has_bf16_kernels", lambda native=native: native)
        assert widens_bf16("bf16", torch.device("cpu")) is not native
        assert not widens_bf16("fp32", torch.device("cpu"))
        assert not widens_bf16("bf16", torch.device("cuda", 0))
        assert not widens_bf16("fp16", torch.device("cpu"))


def test_a_dtensors_matmul_takes_the_path_through_its_local_shards(widening, monkeypatch):
    """On a 1-rank gloo mesh: a row-sharded times a column-sharded DTensor, forward and backward,
    gives the fp32 product rounded once, as a plain tensor's matmul does."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from helpers.processes import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        a, b = torch.randn(6, 8, dtype=BF16), torch.randn(8, 5, dtype=BF16)
        da = distribute_tensor(a.clone().requires_grad_(), mesh, [Shard(0)])
        db = distribute_tensor(b.clone().requires_grad_(), mesh, [Shard(1)])
        with bf16_in_fp32("bf16", torch.device("cpu")):
            product = torch.mm(da, db)
            product.full_tensor().float().sum().backward()
        assert torch.equal(product.full_tensor(), (a.float() @ b.float()).to(BF16))
        assert da.grad is not None and da.grad.full_tensor().dtype == BF16
    finally:
        dist.destroy_process_group()
