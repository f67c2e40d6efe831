"""The driver's NCCL/CUDA/transport and storage-endpoint variables reach the workers; credentials and the
device list do not. A DeepSpeed rank builds its ops with the ninja installed beside its interpreter."""

from helpers.config import compose_config
from orch.config import to_typed
from orch.launchers.passthrough import passthrough_env
from orch.launchers.worker_group import worker_env
from orch.plans.resolve import resolve_plan


def test_communication_variables_pass_and_others_do_not():
    environ = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
               "CUDA_DEVICE_MAX_CONNECTIONS": "1", "UCX_TLS": "rc", "FI_PROVIDER": "efa",
               "CUDA_VISIBLE_DEVICES": "0,1", "HOME": "/root", "PATH": "/bin",
               "NCCL_IB_TOKEN": "t", "UCX_SECRET": "s", "FI_PASSWORD": "p", "CUDA_API_KEY": "k",
               "AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_DEFAULT_REGION": "eu-west-1",
               "AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t"}
    assert passthrough_env(environ) == {
        "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1", "UCX_TLS": "rc", "FI_PROVIDER": "efa",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_DEFAULT_REGION": "eu-west-1"}


def test_the_driver_s_worker_env_includes_them(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("NCCL_AUTH_TOKEN", "never")
    cfg, _, _ = to_typed(compose_config())
    env = worker_env(resolve_plan(cfg.plan, cfg.cluster, cfg.train).accelerator)
    assert env["NCCL_DEBUG"] == "WARN" and "NCCL_AUTH_TOKEN" not in env


def test_a_deepspeed_rank_builds_with_the_ninja_beside_its_interpreter_even_when_path_lacks_it(monkeypatch):
    import os
    import shutil
    import sys

    from orch.launchers.engines.deepspeed.building import ninja_on_path

    scripts = os.path.dirname(sys.executable)
    assert os.path.isfile(os.path.join(scripts, "ninja"))  # DeepSpeed requires the ninja package
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # as when .venv/bin/orch runs without activating
    ninja_on_path()
    ninja_on_path()
    assert os.environ["PATH"] == f"{scripts}:/usr/bin:/bin"
    assert shutil.which("ninja") == os.path.join(scripts, "ninja")
