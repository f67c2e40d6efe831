"""The orchestrator: CLI, driver and tracking glue over plans/ and launchers/."""
