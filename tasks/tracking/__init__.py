"""MLflow: a run per stage that loses nothing, the model registry, lineage, and the progress the person
running it sees."""
