"""The pipeline's stages, one module each, named as its dvc.yaml stage (`reward-model` -> reward_model.py).

Each module has `run(params, paths) -> metrics`: it reads only its own section of params.yaml (plus `base`),
reads the inputs and writes the outputs dvc.yaml declares for it, and returns the metrics it wrote.
"""

STAGES = {  # dvc.yaml stage name -> module, in the pipeline's order
    "prepare": "tasks.stages.prepare",
    "validate": "tasks.stages.validate",
    "sft": "tasks.stages.sft",
    "reward-model": "tasks.stages.reward_model",
    "inspect": "tasks.stages.inspect",
    "train": "tasks.stages.train",
    "evaluate": "tasks.stages.evaluate",
    "register": "tasks.stages.register",
}
