"""The pipeline under the flows: one module per DVC stage, the rooms they are built from, and the runner.

    stages/      one module per dvc.yaml stage: run(params, paths) -> metrics
    runner.py    `rlhf stage NAME`: params, the stage's MLflow run, the stage, its execution figures
    parameters/  params.yaml (profiles, overrides, trust) validated once; the workspace's paths
    execution/   the launch on several processes, how a stage ended, which failures a retry can fix
    tracking/    MLflow runs that lose nothing, the model registry, lineage, progress
    dag/         dvc.yaml: the stages in order, each one's module, the code deps each runs
    data/        dataset layouts and rows as text;  checks/  GX suites and model checks
    reports/     plots and the sweep's frontier;  from_trl/  TRL recipes and flags into params
    demo_world/  the built-in world's tiny models and gold reward

No room imports a stage or the runner, and the rooms form no circle (tests/test_architecture.py).
"""
