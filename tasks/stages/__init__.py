"""The pipeline's stages, one module each, named as its dvc.yaml stage (`reward-model` -> reward_model.py).

Each module has `run(params, paths) -> metrics`: it reads only its own section of params.yaml (plus `base`),
reads the inputs and writes the outputs dvc.yaml declares for it, and returns the metrics it wrote.
`tasks/runner.py` runs one by name (tasks/dag/stage_modules.py); no stage imports another.
"""
