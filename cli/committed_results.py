"""After `rlhf run`: the committed results (dvc.lock, metrics/) that the run rewrote, and what to do with them.

The same code and parameters give results that differ in their last digits between CPUs (their floating-point
kernels differ: AVX2 or AVX-512, a library's choice of blocking), and the first run in a fresh clone reruns every
stage (the models are in no git commit and DVC's cache is empty). So on a machine other than the one that made
the commit, that run rewrites dvc.lock's hashes and metrics/*.json. Said once, at the end of the run, with how to
keep or drop the new figures; files already edited before the run are left out (the run is not why they differ).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import typer

RESULTS = ("dvc.lock", "metrics")


def _git(root: Path, *args: str) -> list[str] | None:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.split() if proc.returncode == 0 else None


def unchanged_results(root: Path) -> set[str]:
    """The committed result files the workspace has not changed (empty outside git or before a first commit)."""
    committed = _git(root, "ls-files", "--", *RESULTS)
    changed = _git(root, "diff", "--name-only", "HEAD", "--", *RESULTS)
    if committed is None or changed is None:
        return set()
    return set(committed) - set(changed)


def say_rewritten_results(root: Path, unchanged_before: set[str]) -> None:
    """A note naming the committed results this run changed (of those unchanged before it), why, and what to do."""
    changed = _git(root, "diff", "--name-only", "HEAD", "--", *RESULTS) or []
    rewritten = sorted(set(changed) & unchanged_before)
    if not rewritten:
        return
    typer.echo(f"note: this run rewrote committed results: {', '.join(rewritten)}. The same code and parameters "
               "give results that differ in their last digits between CPUs (their floating-point kernels differ), "
               "and a first run in a fresh clone reruns every stage, so another machine's commit is rewritten. "
               "`git diff --stat -- dvc.lock metrics` shows by how much. Keep this machine's figures: "
               "`git commit -m 'results on this machine' -- dvc.lock metrics`; drop them from git's view: "
               "`git checkout -- dvc.lock metrics` (the next run then reruns the stages whose outputs differ from "
               "dvc.lock, to the same figures).", err=True)
