"""`orch <command> [hydra overrides]`: the command picks a Hydra app, the rest is Hydra's.

Hydra owns ``sys.argv`` once a command is chosen, so overrides, ``--multirun``, ``--cfg job``
and ``--help`` all behave as in any Hydra app.
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from launchers.ray_auth import use_token_auth_if_available
from orchestrator.config import register_configs, to_typed
from plans.errors import OrchError

register_configs()

USAGE = """usage: orch <command> [overrides...]

commands:
  train    train the declared run on Ray with DeepSpeed, tracked in MLflow
  check    predict per-device memory of the plan and say whether it fits [--json]
  config   print the composed config (same overrides as train)

`check` exits 0 when the plan fits, 1 when it does not, 2 on invalid input.
Overrides are Hydra's: key=value, group=option, --multirun a=1,2. See README.md.
"""

# Exit code for a run refused because of the user's input (plan, config).
EXIT_USAGE = 2


def _fail(error: OrchError) -> None:
    from launchers.worker_group import WorkerDiedError, WorkerFailedError, WorkerHangError

    print(f"error: {error}", file=sys.stderr)
    # A failure inside training is not the user's input: exit 1, as a crashed script would.
    runtime = (WorkerFailedError, WorkerHangError, WorkerDiedError)
    sys.exit(1 if isinstance(error, runtime) else EXIT_USAGE)


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="config")
def train_app(cfg: DictConfig) -> None:
    from orchestrator.driver import run_training

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    try:
        typed, model_cfg, yaml = to_typed(cfg)
        run_training(typed, model_cfg, yaml)
    except OrchError as error:
        _fail(error)


# Set by main() from `--json`, which Hydra itself would reject.
_OPTIONS = {"json": False}


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="config")
def check_app(cfg: DictConfig) -> None:
    import json

    from orchestrator.checking import check_run, live_cluster, render

    try:
        typed, model_cfg, _ = to_typed(cfg)
        cluster, notes = live_cluster(typed)
        estimate, _ = check_run(typed, model_cfg, cluster)
    except OrchError as error:
        _fail(error)
    if _OPTIONS["json"]:
        doc = estimate.as_json()
        doc["cluster"] = {"source": "live" if cluster.address and cluster.discover else "declared",
                          "notes": notes, "nodes": cluster.nodes, "devices_per_node": cluster.devices_per_node,
                          "device_memory_gib": cluster.device_memory_gib, "host_memory_gib": cluster.host_memory_gib}
        print(json.dumps(doc, indent=2))
    else:
        print(render(estimate, cluster, notes))
    if not estimate.feasible:
        sys.exit(1)


@hydra.main(version_base="1.3", config_path="pkg://conf", config_name="config")
def config_app(cfg: DictConfig) -> None:
    print(OmegaConf.to_yaml(cfg, resolve=True))


COMMANDS = {"train": train_app, "check": check_app, "config": config_app}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    _OPTIONS["json"] = "--json" in rest
    rest = [a for a in rest if a != "--json"]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return EXIT_USAGE
    use_token_auth_if_available()
    sys.argv = [f"orch-{command}", *rest]
    COMMANDS[command]()
    return 0
