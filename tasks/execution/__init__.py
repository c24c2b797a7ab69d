"""How a stage process runs: its launch on several processes, how it ended, which failures a retry can
fix, and the figures of its execution (seconds, episodes/s) kept out of DVC's outputs."""
