"""The pipeline: `stages/` holds one module per DVC stage; `common/` holds what they share."""
