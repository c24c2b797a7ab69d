"""What a run is given: params.yaml with a profile and overrides, validated once, and the workspace's paths."""
