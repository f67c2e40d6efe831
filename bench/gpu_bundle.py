"""Wheels that make `orch` installable on an offline GPU machine, in trips small enough to send.

The lent GPU machine (docs/gpu.md) has Python 3.12 and its own torch, but neither Ray, DeepSpeed,
MLflow nor Hydra, and no network; each command sends at most 64 MiB along. Two steps:

    python -m bench.gpu_bundle build [--out .gpu_bundle] [--trip-mib 56]      # here, with network
    python3 -m bench.gpu_bundle install .gpu_bundle/trip-1 [--target /tmp/site]  # there, per trip

``build`` makes wheels of `orch` and of DeepSpeed (pure Python: its ops are JIT-built where they
run), resolves `orch`'s whole closure (its ``fp8`` extra, torchao, included) for CPython 3.12 on
manylinux x86_64 against what the machine already has (``bench/gpu_machine_packages.txt``, at the
versions listed there), downloads the rest as wheels, drops from Ray's wheel what a headless Python
run never loads (its Java jar and the dashboard's source maps), checks with pip that the bundle plus
the machine's packages resolve with no index at all and that nothing in it replaces one of the
machine's packages, and packs the wheels into trips of at most ``--trip-mib`` MiB (a wheel larger
than a trip is split into parts).

``install`` stages one trip's files under ``--stage`` (verified against the manifest's SHA-256),
and once every file of the manifest is staged, joins split wheels, installs them all with
``pip install --no-index --no-deps --target`` (the machine's torch stays untouched) and runs
``pip check``. It uses the standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MACHINE_PACKAGES = REPO / "bench" / "gpu_machine_packages.txt"
PYTHON_VERSION = "3.12"
# pip matches manylinux tags exactly: every glibc level up to the machine's (Ubuntu 24.04: 2.39).
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{minor}_x86_64" for minor in range(5, 40)), "linux_x86_64"]
# Members of Ray's wheel that a headless Python run never loads: the Java workers' jar (31 MiB of
# the wheel's 76) and the dashboard's JavaScript source maps.
RAY_DROPPED = re.compile(r"^ray/jars/|\.js\.map$")
EXTRAS = "[fp8]"
"""`orch`'s optional dependencies the bundle carries: torchao, for the check's FP8 case."""
MANIFEST = "manifest.json"
MiB = 2**20


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def machine_packages(path: Path = MACHINE_PACKAGES) -> dict[str, str | None]:
    """The machine's distributions: canonical name -> version (None where not known)."""
    packages: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        packages[canonical(name)] = version.strip() or None
    return packages


def target_args(python_version: str = PYTHON_VERSION) -> list[str]:
    """pip's arguments that make it pick wheels for the GPU machine instead of this one."""
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            "--abi", f"cp{python_version.replace('.', '')}"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


# ---------------------------------------------------------------------------------------- build


@dataclass(frozen=True)
class Resolved:
    name: str
    version: str
    local: bool
    """Built here (orch, DeepSpeed) rather than downloaded."""


def pip(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # --isolated: no user configuration or PIP_* variables change what is resolved.
    command = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "--quiet", *args]
    return subprocess.run(command, check=True, text=True, env=env)


# Distributions in orch's closure that PyPI ships as source archives only: built here into wheels,
# which must come out pure Python (DeepSpeed's with no op prebuilt: its ops are JIT-compiled on the
# GPU machine by the CUDA compiler there, against that machine's torch).
SOURCE_ONLY = ("deepspeed", "antlr4-python3-runtime")


def build_local_wheels(local: Path) -> None:
    """Wheels of `orch` (this checkout) and of :data:`SOURCE_ONLY`, at the versions installed here
    (the ones the project is tested with) where they are."""
    from importlib.metadata import PackageNotFoundError, version

    local.mkdir(parents=True, exist_ok=True)
    leftovers = [path for path in (REPO / "build", REPO / "orch.egg-info") if not path.exists()]
    pip("wheel", "--no-deps", "-w", str(local), str(REPO))
    for path in leftovers:  # setuptools builds in the checkout; what it left there is not the user's
        shutil.rmtree(path, ignore_errors=True)
    for name in SOURCE_ONLY:
        try:
            requirement = f"{name}=={version(name)}"
        except PackageNotFoundError:
            requirement = name
        # No build isolation: DeepSpeed's setup imports torch to record its version, and an
        # isolated build would download a multi-GB torch for that.
        pip("wheel", "--no-deps", "--no-build-isolation", "--no-binary", name, "-w", str(local), requirement,
            env={**os.environ, "DS_BUILD_OPS": "0"})
    for wheel in local.glob("*.whl"):
        if not wheel.name.endswith("-none-any.whl"):
            raise SystemExit(f"{wheel.name} is not pure Python: it would not run on the GPU machine")


def constraints_file(packages: dict[str, str | None], directory: Path) -> Path:
    path = directory / "machine-constraints.txt"
    path.write_text("".join(f"{name}=={version}\n" for name, version in sorted(packages.items()) if version))
    return path


def resolve(local: Path, constraints: Path, work: Path, *, index: bool, extra_links: list[Path] = ()) -> list[Resolved]:
    """`orch`'s whole closure for the GPU machine, as pip resolves it (``--dry-run --report``) from
    the wheels in ``local`` (`orch`'s among them) and ``extra_links``, and the index if ``index``."""
    report = work / f"report-{'index' if index else 'offline'}.json"
    links = [arg for path in (local, *extra_links) for arg in ("--find-links", str(path))]
    pip("install", "--dry-run", "--ignore-installed", "--report", str(report), "--target", str(work / "target"),
        *target_args(), *links, *([] if index else ["--no-index"]), "-c", str(constraints),
        # The wheel itself, not the name: PyPI has another project called orch.
        str(next(local.glob("orch-*.whl"))) + EXTRAS)
    items = json.loads(report.read_text())["install"]
    local_names = {canonical(p.name.split("-")[0]) for p in local.glob("*.whl")} if index else set()
    return [Resolved(name=canonical(item["metadata"]["name"]), version=item["metadata"]["version"],
                     local=canonical(item["metadata"]["name"]) in local_names) for item in items]


def slim_wheel(wheel: Path, dropped: re.Pattern) -> int:
    """Rewrite ``wheel`` without the members ``dropped`` matches (their RECORD lines too); the
    bytes saved."""
    before = wheel.stat().st_size
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            if dropped.search(info.filename):
                continue
            data = source.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not dropped.search(line.split(",", 1)[0])).encode()
            target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    slim.replace(wheel)
    return before - wheel.stat().st_size


def stub_wheel(directory: Path, name: str, version: str) -> Path:
    """An empty wheel that stands for a distribution the GPU machine already has, so that pip can
    resolve against the machine's packages with no index."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: orch-gpu-bundle\n"
                                                  "Root-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            digest.update(block)
    return digest.hexdigest()


def plan_trips(sizes: dict[str, int], trip_bytes: int) -> list[list[str]]:
    """Files packed into as few trips of at most ``trip_bytes`` as first-fit by decreasing size
    finds (every file must fit one trip: split larger ones first)."""
    trips: list[list[str]] = []
    room: list[int] = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        if sizes[name] > trip_bytes:
            raise ValueError(f"{name} ({sizes[name]} bytes) is larger than a trip ({trip_bytes} bytes)")
        for index, free in enumerate(room):
            if sizes[name] <= free:
                trips[index].append(name)
                room[index] -= sizes[name]
                break
        else:
            trips.append([name])
            room.append(trip_bytes - sizes[name])
    return trips


def split_file(path: Path, part_bytes: int, into: Path) -> list[Path]:
    """``path`` cut into files ``NAME.partNN`` of at most ``part_bytes`` under ``into``."""
    parts = []
    with path.open("rb") as f:
        for index, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
            part = into / f"{path.name}.part{index:02d}"
            part.write_bytes(block)
            parts.append(part)
    return parts


def build(out: Path, trip_mib: float) -> dict:
    """Build the bundle under ``out`` (see the module docstring); returns the manifest."""
    machine = machine_packages()
    if out.exists():
        shutil.rmtree(out)
    work = out / "work"
    local, wheels, stubs = work / "local", work / "wheels", work / "stubs"
    for directory in (local, wheels, stubs):
        directory.mkdir(parents=True)
    print("building the wheels of orch and DeepSpeed", flush=True)
    build_local_wheels(local)
    constraints = constraints_file(machine, work)
    print("resolving orch's dependencies for CPython 3.12 on manylinux x86_64", flush=True)
    closure = resolve(local, constraints, work, index=True)
    provided = [r for r in closure if r.name in machine and not r.local]
    needed = [r for r in closure if r.name not in machine and not r.local]
    if clash := [r.name for r in closure if r.local and r.name in machine]:
        raise SystemExit(f"built here but already on the machine: {clash}")
    print(f"{len(closure)} distributions: {len(provided)} on the machine, {len(needed)} to download, "
          f"{len(closure) - len(provided) - len(needed)} built here", flush=True)
    pip("download", "--no-deps", "-d", str(wheels), *target_args(), *(f"{r.name}=={r.version}" for r in needed))
    for wheel in local.glob("*.whl"):
        shutil.copy2(wheel, wheels)
    slimmed = {}
    for wheel in wheels.glob("ray-*.whl"):
        slimmed[wheel.name] = slim_wheel(wheel, RAY_DROPPED)
    # The proof: the bundle plus stand-ins for the machine's packages, at the versions resolved,
    # resolve orch with no index; and every distribution pip picks is one of the two.
    for r in provided:
        stub_wheel(stubs, r.name, r.version)
    offline = resolve(wheels, constraints, work, index=False, extra_links=[stubs])
    bundled = {canonical(p.name.split("-")[0]) for p in wheels.glob("*.whl")}
    if stray := sorted(r.name for r in offline if r.name not in bundled and r.name not in machine):
        raise SystemExit(f"the offline resolution picked distributions that are neither bundled nor on the machine: "
                         f"{stray}")
    if replaced := sorted(bundled & set(machine)):
        raise SystemExit(f"the bundle would replace the machine's own {replaced}")
    print(f"verified: orch resolves offline from the bundle's {len(bundled)} wheels and the machine's packages",
          flush=True)
    return pack(wheels, out, trip_mib, machine={r.name: r.version for r in provided}, slimmed=slimmed)


def pack(wheels: Path, out: Path, trip_mib: float, *, machine: dict[str, str], slimmed: dict[str, int]) -> dict:
    """Spread the wheels over trip directories ``out/trip-N``, each with the whole manifest."""
    trip_bytes = int(trip_mib * MiB)
    files: dict[str, dict] = {}
    sizes: dict[str, int] = {}
    staging = out / "work" / "parts"
    staging.mkdir(parents=True, exist_ok=True)
    sources: dict[str, Path] = {}
    for wheel in sorted(wheels.glob("*.whl")):
        entry = {"sha256": sha256(wheel), "bytes": wheel.stat().st_size, "parts": []}
        if wheel.stat().st_size > trip_bytes:
            for part in split_file(wheel, trip_bytes, staging):
                entry["parts"].append({"name": part.name, "sha256": sha256(part)})
                sizes[part.name] = part.stat().st_size
                sources[part.name] = part
        else:
            sizes[wheel.name] = wheel.stat().st_size
            sources[wheel.name] = wheel
        files[wheel.name] = entry
    trips = plan_trips(sizes, trip_bytes)
    manifest = {"python": PYTHON_VERSION, "trips": len(trips), "files": files,
                "trip_of": {name: index for index, names in enumerate(trips, start=1) for name in names},
                "machine": dict(sorted(machine.items())),
                "slimmed": {name: f"dropped {saved / MiB:.1f} MiB: {RAY_DROPPED.pattern}"
                            for name, saved in slimmed.items()}}
    for index, names in enumerate(trips, start=1):
        trip = out / f"trip-{index}"
        trip.mkdir()
        for name in names:
            shutil.copy2(sources[name], trip / name)
        (trip / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    shutil.rmtree(staging)
    return manifest


# -------------------------------------------------------------------------------------- install


def stage_trip(trip: Path, stage: Path) -> dict:
    """Copy one trip's files into ``stage``, each checked against the manifest; the manifest."""
    manifest = json.loads((trip / MANIFEST).read_text())
    stage.mkdir(parents=True, exist_ok=True)
    expected = expected_digests(manifest)
    for path in sorted(trip.iterdir()):
        if path.name == MANIFEST:
            continue
        if path.name not in expected:
            raise SystemExit(f"{path}: not in the bundle's manifest")
        if sha256(path) != expected[path.name]:
            raise SystemExit(f"{path}: its SHA-256 differs from the manifest's (a broken transfer?)")
        shutil.copy2(path, stage / path.name)
    (stage / MANIFEST).write_text(json.dumps(manifest))
    return manifest


def expected_digests(manifest: dict) -> dict[str, str]:
    """Every file a trip can carry (whole wheels and the parts of split ones) -> its SHA-256."""
    expected = {}
    for name, entry in manifest["files"].items():
        if entry["parts"]:
            expected.update({part["name"]: part["sha256"] for part in entry["parts"]})
        else:
            expected[name] = entry["sha256"]
    return expected


def missing_trips(manifest: dict, stage: Path) -> list[int]:
    """The trips whose files are not all staged yet."""
    missing = {manifest["trip_of"][name] for name, digest in expected_digests(manifest).items()
               if not (stage / name).exists()}
    return sorted(missing)


def join_parts(manifest: dict, stage: Path) -> None:
    """Reassemble each split wheel from its staged parts and check it."""
    for name, entry in manifest["files"].items():
        if not entry["parts"] or (stage / name).exists():
            continue
        with (stage / name).open("wb") as whole:
            for part in entry["parts"]:
                whole.write((stage / part["name"]).read_bytes())
        if sha256(stage / name) != entry["sha256"]:
            (stage / name).unlink()
            raise SystemExit(f"{name}: the joined parts do not give the manifest's SHA-256")


def install(trip: Path, stage: Path, target: Path) -> int:
    manifest = stage_trip(trip, stage)
    if missing := missing_trips(manifest, stage):
        print(f"staged {trip.name} under {stage}; still to send: " + ", ".join(f"trip-{i}" for i in missing))
        return 0
    join_parts(manifest, stage)
    wheels = [str(stage / name) for name in sorted(manifest["files"])]
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
                    "--no-deps", "--no-compile", "--upgrade", "--target", str(target), *wheels], check=True)
    print(f"installed {len(wheels)} wheels into {target}; use them with:\n"
          f"  export PYTHONPATH={target}${{PYTHONPATH:+:$PYTHONPATH}} PATH={target}/bin:$PATH")
    # What the bundle needs of the machine's packages, at the machine's real versions.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
    check = subprocess.run([sys.executable, "-m", "pip", "check", "--disable-pip-version-check"], env=env,
                           capture_output=True, text=True)
    ours = {canonical(name.split("-")[0]) for name in manifest["files"]}
    # pip check also lists what the machine's own packages lack among themselves: only the lines
    # that name a distribution of the bundle are the bundle's business.
    problems = [line for line in check.stdout.splitlines()
                if {canonical(word.strip(",.")) for word in line.split()} & ours]
    print("pip check: " + ("no problem with the bundle's distributions" if not problems
                           else "\n  " + "\n  ".join(problems)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="build the bundle here (needs the package index)")
    build_cmd.add_argument("--out", type=Path, default=REPO / ".gpu_bundle")
    build_cmd.add_argument("--trip-mib", type=float, default=56.0,
                           help="largest trip; the working tree travels beside it within the 64 MiB a call sends")
    install_cmd = commands.add_parser("install", help="stage a trip on the GPU machine; install once all are there")
    install_cmd.add_argument("trip", type=Path)
    install_cmd.add_argument("--stage", type=Path, default=Path(tempfile.gettempdir()) / "orch-bundle")
    install_cmd.add_argument("--target", type=Path, default=Path(tempfile.gettempdir()) / "site")
    args = parser.parse_args(argv)
    if args.command == "build":
        manifest = build(args.out, args.trip_mib)
        for index in range(1, manifest["trips"] + 1):
            trip = args.out / f"trip-{index}"
            size = sum(p.stat().st_size for p in trip.iterdir())
            print(f"{trip}: {size / MiB:.1f} MiB, {len(list(trip.iterdir())) - 1} files")
        return 0
    return install(args.trip, args.stage, args.target)


if __name__ == "__main__":
    sys.exit(main())
