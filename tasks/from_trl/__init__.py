"""Reading TRL's recipes and script flags into params.yaml (`rlhf from-trl`)."""
