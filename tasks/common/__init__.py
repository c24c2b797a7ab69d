"""What the stages share: params, paths, models, progress, plots, MLflow tracking, dvc.yaml, GX suites."""
