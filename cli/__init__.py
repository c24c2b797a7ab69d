"""The `rlhf` command line: the top floor. It may import flows and tasks; nothing imports it."""
