"""Tracking in MLflow: the store and its checks (store), a training run's params and step
metrics (train_run, step_metrics) and the reports read back from tracked runs (report)."""
