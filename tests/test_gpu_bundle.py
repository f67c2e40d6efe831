"""The GPU bundle (bench/gpu_bundle.py) and the one-GPU check (bench/gpu_check.py), without a GPU.

The bundle's trips are made of real wheels here and installed by real pip with no index, trip by
trip, as on the GPU machine; the offline resolution that proves a bundle complete runs on
stand-in wheels. The check's cases are composed into typed configs, and its dry run is the command
a user runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import gpu_bundle, gpu_check

REPO = Path(__file__).resolve().parents[1]


def wheel(directory: Path, name: str, version: str, *, requires: tuple[str, ...] = (), payload: int = 0,
          files: dict[str, bytes] | None = None) -> Path:
    """A real installable wheel: a module ``name`` with ``payload`` bytes of incompressible data."""
    import os

    dist = f"{name}-{version}"
    path = directory / f"{dist}-py3-none-any.whl"
    members = {f"{name}/__init__.py": b"", **(files or {})}
    if payload:
        members[f"{name}/data.bin"] = os.urandom(payload)
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    members[f"{dist}.dist-info/METADATA"] = metadata.encode()
    members[f"{dist}.dist-info/WHEEL"] = b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{m},,\n" for m in members) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for member, data in members.items():
            z.writestr(member, data)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


def test_trips_are_packed_first_fit_by_decreasing_size():
    sizes = {"a": 50, "b": 30, "c": 30, "d": 20, "e": 10}
    trips = gpu_bundle.plan_trips(sizes, 60)
    assert trips == [["a", "e"], ["b", "c"], ["d"]]
    assert all(sum(sizes[n] for n in trip) <= 60 for trip in trips)
    with pytest.raises(ValueError, match="larger than a trip"):
        gpu_bundle.plan_trips({"huge": 61}, 60)


def test_the_machine_list_pins_its_torch_and_names_what_the_bundle_must_not_replace():
    machine = gpu_bundle.machine_packages()
    assert machine["torch"] == "2.11.0"
    assert {"torchvision", "triton", "nvidia-nccl-cu13", "numpy", "transformers"} <= set(machine)
    # What the GPU machine lacks is what the bundle is for.
    assert not {"ray", "deepspeed", "mlflow", "hydra-core", "omegaconf"} & set(machine)


def test_slimming_drops_the_members_and_their_record_lines(tmp_path):
    path = wheel(tmp_path, "ray", "2.60.0", files={"ray/jars/ray_dist.jar": b"j" * 1000,
                                                   "ray/dashboard/main.js.map": b"m" * 1000,
                                                   "ray/dashboard/main.js": b"x"})
    assert gpu_bundle.slim_wheel(path, gpu_bundle.RAY_DROPPED) > 0
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        record = z.read("ray-2.60.0.dist-info/RECORD").decode()
    assert "ray/jars/ray_dist.jar" not in names and "ray/dashboard/main.js.map" not in names
    assert "ray/dashboard/main.js" in names and "ray/dashboard/main.js" in record
    assert "jars" not in record and ".js.map" not in record


def test_trips_install_with_no_index_once_all_are_staged(tmp_path):
    """A wheel larger than a trip travels in parts; each trip is staged; the last one installs
    everything into the target directory and the modules import from there."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel(wheels, "big", "1.0", payload=300_000)
    wheel(wheels, "small", "2.0", requires=("big",), payload=1000)
    manifest = gpu_bundle.pack(wheels, tmp_path / "bundle", trip_mib=0.2, machine={}, slimmed={})
    assert manifest["files"]["big-1.0-py3-none-any.whl"]["parts"], "the large wheel is split"
    trips = sorted((tmp_path / "bundle").glob("trip-*"))
    assert len(trips) == manifest["trips"] >= 2
    assert all(sum(p.stat().st_size for p in t.iterdir() if p.name != "manifest.json") <= 0.2 * 2**20
               for t in trips)
    stage, target = tmp_path / "stage", tmp_path / "site"
    for trip in trips[:-1]:
        run = subprocess.run([sys.executable, "-m", "bench.gpu_bundle", "install", str(trip), "--stage", str(stage),
                              "--target", str(target)], cwd=REPO, capture_output=True, text=True, check=True)
        assert "still to send" in run.stdout and not target.exists()
    run = subprocess.run([sys.executable, "-m", "bench.gpu_bundle", "install", str(trips[-1]), "--stage", str(stage),
                          "--target", str(target)], cwd=REPO, capture_output=True, text=True, check=True)
    assert "installed 2 wheels" in run.stdout
    assert "no problem with the bundle's distributions" in run.stdout
    assert (target / "big" / "data.bin").stat().st_size == 300_000
    assert (target / "small-2.0.dist-info").is_dir()


def test_a_damaged_part_is_refused(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel(wheels, "big", "1.0", payload=300_000)
    gpu_bundle.pack(wheels, tmp_path / "bundle", trip_mib=0.2, machine={}, slimmed={})
    trip = tmp_path / "bundle" / "trip-1"
    part = next(p for p in trip.iterdir() if p.name != "manifest.json")
    data = part.read_bytes()
    part.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # a byte that differs, whatever it was
    with pytest.raises(SystemExit, match="SHA-256"):
        gpu_bundle.stage_trip(trip, tmp_path / "stage")


def test_the_offline_resolution_uses_only_the_bundle_and_the_machine(tmp_path):
    """What ``build`` proves a bundle with: pip resolves orch for CPython 3.12 from the bundle's
    wheels and stand-ins for the machine's packages, with no index."""
    bundle, stubs = tmp_path / "bundle", tmp_path / "stubs"
    bundle.mkdir()
    stubs.mkdir()
    wheel(bundle, "orch", "0.1.0", requires=("helper>=1", "torch"))
    wheel(bundle, "helper", "1.2")
    gpu_bundle.stub_wheel(stubs, "torch", "2.11.0")
    constraints = gpu_bundle.constraints_file({"torch": "2.11.0"}, tmp_path)
    resolved = gpu_bundle.resolve(bundle, constraints, tmp_path, index=False, extra_links=[stubs])
    assert {(r.name, r.version) for r in resolved} == {("orch", "0.1.0"), ("helper", "1.2"), ("torch", "2.11.0")}
    (stubs / "torch-2.11.0-py3-none-any.whl").unlink()
    with pytest.raises(subprocess.CalledProcessError):  # torch is neither bundled nor on the machine
        gpu_bundle.resolve(bundle, constraints, tmp_path, index=False, extra_links=[stubs])


def test_every_case_of_the_gpu_check_composes_into_a_valid_config(tmp_path):
    from hydra import compose, initialize_config_module

    from orch.config import register_configs, to_typed
    from orch.plans.spec import Recompute

    machine = gpu_check.Machine(gpu="test", gpus=1, memory_gib=79.2, host_memory_gib=125, cpus=16)
    fp8_machine = gpu_check.Machine(gpu="NVIDIA H100 80GB HBM3", gpus=1, memory_gib=79.2, host_memory_gib=125,
                                    cpus=16, tflops=gpu_check.DENSE_TFLOPS["H100"])
    register_configs()
    with initialize_config_module("orch.conf", version_base="1.3"):
        for case in gpu_check.CASES:
            on = fp8_machine if "fp8" in case.plan else machine
            typed, model_cfg, _ = to_typed(compose("config", overrides=case.overrides(gpu_check.GPU_SETUP, on,
                                                                                       tmp_path)))
            plan = typed.plan
            assert (plan.engine, plan.zero_stage, plan.offload_optimizer.value, plan.offload_param.value,
                    Recompute.of(plan.activation_checkpointing), plan.precision.value, plan.compile) == \
                gpu_check.plan_key(gpu_check.PLANS[case.plan])
            assert typed.cluster.accelerator.value == "gpu" and plan.precision.value in ("bf16", "fp8")
            # An FP8 case runs on a GPU whose rates the check knows; on another the others name none.
            fp8 = plan.precision.value == "fp8"
            rates = (typed.cluster.device_tflops, typed.cluster.device_fp8_tflops)
            assert rates == ((989, 1979) if fp8 else (None, None))
            assert typed.cluster.cpus_per_worker == 14 and typed.train.steps == gpu_check.GPU_SETUP.steps


def test_the_dry_run_says_what_it_would_run_without_a_gpu():
    run = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run"], cwd=REPO, capture_output=True,
                         text=True, check=True)
    for case in gpu_check.CASES:
        assert f"{case.name}: " in run.stdout
    assert "orch export" in run.stdout and "FusedAdam" in run.stdout


def test_the_report_marks_misses_and_lists_failures():
    setup, machine = gpu_check.GPU_SETUP, gpu_check.Machine(gpu="H100", gpus=1, memory_gib=79.2,
                                                            host_memory_gib=125, cpus=16)
    cases = {c.name: c for c in gpu_check.CASES}
    good = gpu_check.Outcome(cases["gpt-1b-zero2"], status="ok", losses=[5.6, 3.1], step_time_s=0.2,
                             predicted_step_s=0.25, tflops=300.0, mfu=0.41, measured_peak=20 * 2**30,
                             predicted_peak=21 * 2**30, optimizer="deepspeed.FusedAdam")
    off = gpu_check.Outcome(cases["llama-1b-zero2"], status="ok", losses=[5.0, 5.2], measured_peak=10 * 2**30,
                            predicted_peak=13 * 2**30)
    failed = gpu_check.Outcome(cases["gpt-1b-zero3"], status="failed (exit 1)", error="RuntimeError: CUDA error")
    text = gpu_check.report(setup, machine, "torch 2.11", [good, off, failed], ["a note"], "now", 60.0)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "+5.0%" in rows["gpt-1b-zero2"] and "1.25" in rows["gpt-1b-zero2"] and "41.0%" in rows["gpt-1b-zero2"]
    assert "**+30.0%**" in rows["llama-1b-zero2"] and "**no**" in rows["llama-1b-zero2"]
    assert "## Failures" in text and "RuntimeError: CUDA error" in text and "- a note" in text
    json.dumps(text)  # plain text, nothing else
