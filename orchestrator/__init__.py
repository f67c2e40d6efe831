"""The orchestrator: the CLI, its config and the checks shared by its commands, with sub-packages
run/ (`orch train`'s driver and start-up), tune/ and tracking/, over plans/ and launchers/."""
