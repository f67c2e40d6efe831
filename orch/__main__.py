"""`orch` and `python -m orch`: the command line, imported with the garbage collector paused."""

import sys


def main() -> int:
    from orch.launchers.lean_startup import collector_paused

    with collector_paused():  # Hydra, OmegaConf and the config schemas: start-up (orch.launchers.lean_startup)
        from orch.cli import main as cli_main
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
