"""Each dvc.yaml stage's module in tasks/stages/, in the pipeline's order (tests/test_architecture.py checks
that it matches dvc.yaml and the folder). Names only: importing this loads no stage."""

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
