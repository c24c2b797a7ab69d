"""The pipeline's DAG as dvc.yaml declares it: its stages in order, each stage's module, and the code deps
each stage runs."""
