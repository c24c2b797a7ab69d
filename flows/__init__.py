"""Prefect orchestration of the pipeline: the flow, one task per dvc.yaml stage run through DVC."""
