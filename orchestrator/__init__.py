"""The orchestrator: CLI, config, driver and their sub-packages (tune/, tracking/) over plans/ and launchers/."""
