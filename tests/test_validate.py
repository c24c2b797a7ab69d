"""Data validation: the Great Expectations suites, `rlhf validate`, and the `validate` stage gating the pipeline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from cli.main import app
from tasks.stages.validate import ValidationFailed, check_file

REPO = Path(__file__).resolve().parent.parent
GOOD = {  # texts of the word tokenizer (one token per word); budgets below: prompt 4, completions 3 tokens
    "prompts": [{"prompt": "w2 w3"}, {"prompt": "w4 w5 w6", "reference": "w7"}],
    "sft": [{"prompt": "w2 w3", "completion": "w4"}, {"prompt": "w2 w3", "completion": "w5 w6"}],
    "preferences": [{"prompt": "w2 w3", "chosen": "w4", "rejected": "w5"},
                    {"prompt": "w2 w3", "chosen": "w6", "rejected": "w5 w5 w5"}],
}
BUDGET = ["--max-prompt-tokens", "4", "--max-completion-tokens", "3"]


@pytest.fixture
def workspace(tmp_path, monkeypatch, tokenizer):
    """An empty working directory (no params.yaml: default budgets) with the word tokenizer saved in it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLHF_TRACKING", "off")
    tokenizer.save_pretrained(tmp_path / "tok")
    return tmp_path


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def validate(path: Path, kind: str, *extra: str):
    return CliRunner().invoke(app, ["validate", str(path), "--kind", kind, "--tokenizer", "tok", *BUDGET, *extra])


def edited(kind: str, row: int, **changes) -> list[dict]:
    """The good rows plus a copy of row `row` (1-based) with `changes` (a None value deletes the key)."""
    rows = [dict(r) for r in GOOD[kind]]
    broken = {**rows[row - 1], **changes}
    rows.append({k: v for k, v in broken.items() if v is not None})
    return rows


BROKEN = {  # name: (kind, rows, the failed check's description, its rows)
    "missing column": ("preferences", [{"prompt": "w2", "chosen": "w3"}], "column `rejected` exists", []),
    "null prompt": ("sft", edited("sft", 1, prompt=None) + [{"prompt": None, "completion": "w5"}],
                    "`prompt` is present", [3, 4]),
    "empty completion": ("sft", edited("sft", 2, completion=""), "`completion` is not blank", [3]),
    "blank prompt": ("prompts", edited("prompts", 1, prompt=" \n\t "), "`prompt` is not blank", [3]),
    "number as text": ("sft", edited("sft", 1, completion=42), "`completion` is a string", [3]),
    "list as text": ("preferences", edited("preferences", 1, chosen=["w4"]), "`chosen` is a string", [3]),
    "prompt over budget": ("prompts", edited("prompts", 1, prompt="w2 w3 w4 w5 w6"), "`prompt` has at most 4", [3]),
    "chosen over budget": ("preferences", edited("preferences", 2, chosen="w2 w3 w4 w5"), "`chosen` has at most 3", [3]),
    "reference over budget": ("prompts", edited("prompts", 2, prompt="w9", reference="w2 w3 w4 w5"),
                              "`reference` has at most 3", [3]),
    "repeated prompt": ("prompts", edited("prompts", 2, reference="w8"), "each `prompt` appears once", [2, 3]),
    "chosen equals rejected": ("preferences", edited("preferences", 1, rejected="w4"),
                               "`chosen` differs from `rejected`", [3]),
    "duplicate sft row": ("sft", edited("sft", 2), "no duplicate (`prompt`, `completion`) rows", [2, 3]),
    "duplicate preference row": ("preferences", edited("preferences", 1),
                                 "no duplicate (`prompt`, `chosen`, `rejected`) rows", [1, 3]),
}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_dataset_is_rejected_naming_problem_and_rows(workspace, name):
    kind, rows, description, bad_rows = BROKEN[name]
    result = validate(write_jsonl(workspace / "data.jsonl", rows), kind, "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    failed = [c for d in report["datasets"] for c in d["checks"] if not c["success"]]
    assert [c["description"] for c in failed if c["description"].startswith(description)], failed
    check = next(c for c in failed if c["description"].startswith(description))
    assert check["rows"] == bad_rows and [e["row"] for e in check["examples"]] == bad_rows[:5]
    assert check["unexpected_count"] == len(bad_rows)
    assert len(failed) == 1, f"one problem, one failed check: {failed}"


def test_summary_lists_failed_expectations_with_example_rows(workspace):
    rows = edited("preferences", 1, rejected="w4") + [{"prompt": "w2", "chosen": "  ", "rejected": "w3"}]
    result = validate(write_jsonl(workspace / "prefs.jsonl", rows), "preferences")
    assert result.exit_code == 1
    text = " ".join(result.output.split())  # rich wraps long lines
    assert "Data validation FAILED: 2 of" in text
    assert "chosen differs from rejected" in text and "1 row (row 3)" in text
    assert "chosen is not blank" in text and "row 4" in text and '" "' in text


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_good_files_pass(workspace, suffix):
    path = workspace / f"prefs{suffix}"
    rows = GOOD["preferences"]
    if suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    elif suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    else:
        write_jsonl(path, rows)
    result = validate(path, "preferences")
    assert result.exit_code == 0, result.output
    assert "Data validation passed" in result.output


def test_without_a_tokenizer_validation_refuses_unless_told_to_skip_lengths(workspace):
    path = write_jsonl(workspace / "p.jsonl", GOOD["prompts"])
    refused = CliRunner().invoke(app, ["validate", str(path), "--kind", "prompts"])
    assert refused.exit_code == 2 and "no tokenizer to check token lengths with" in refused.output, refused.output
    skipped = CliRunner().invoke(app, ["validate", str(path), "--kind", "prompts", "--skip-token-lengths"])
    assert skipped.exit_code == 0, skipped.output
    assert "Token lengths were not checked" in " ".join(skipped.output.split())


@pytest.mark.parametrize("where", ["models/tokenizer", "params.yaml"])
def test_the_pipeline_tokenizer_is_the_default_and_long_prompts_fail_naming_rows(workspace, tokenizer, where):
    if where == "models/tokenizer":  # what `prepare` trains for the demo
        tokenizer.save_pretrained(workspace / "models" / "tokenizer")
    else:  # a real profile's tokenizer
        (workspace / "params.yaml").write_text("prepare:\n  tokenizer: tok\n")
    rows = [*GOOD["prompts"], {"prompt": "w2 w3 w4 w5 w6 w7"}, {"prompt": "w2"}, {"prompt": "w3 " * 9}]
    result = CliRunner().invoke(app, ["validate", str(write_jsonl(workspace / "p.jsonl", rows)), "--kind",
                                      "prompts", *BUDGET])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "prompt ≤ 4" in text and "row 3" in text and "row 5" in text and "row 4:" not in text, text


UNREADABLE = {  # file name: (content, what the message must say)
    "garbage.jsonl": (b'{"prompt": "w2"}\n{"prompt": "w3"}\n{"prompt": w4}\n', "line 3 is not valid JSON"),
    "latin1.jsonl": (b'{"prompt": "w2"}\n{"prompt": "caf\xe9"}\n', "line 2 is not UTF-8"),
    "empty.jsonl": (b"\n  \n", "empty"),
    "array.jsonl": (b'{"prompt": "w2"}\n["w3"]\n', "line 2 is list, expected a JSON object"),
    "none.json": (b"[]", "no records"),
    "data.csv": (b"prompt\nw2\n", "unsupported file type '.csv'"),
    "broken.parquet": (b"PAR1 not really", "not a readable Parquet file"),
}


@pytest.mark.parametrize("name", UNREADABLE)
def test_unreadable_file_fails_with_one_clear_message(workspace, name):
    content, message = UNREADABLE[name]
    (workspace / name).write_bytes(content)
    result = validate(workspace / name, "prompts")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert message in result.output and name in result.output, result.output
    assert "Traceback" not in result.output


def test_missing_file_and_bad_tokenizer_fail_cleanly(workspace):
    missing = validate(workspace / "nope.jsonl", "sft")
    assert missing.exit_code == 2 and "nope.jsonl: no such file" in missing.output
    path = write_jsonl(workspace / "p.jsonl", GOOD["prompts"])
    bad = CliRunner().invoke(app, ["validate", str(path), "--kind", "prompts", "--tokenizer", str(workspace / "x")])
    assert bad.exit_code == 2 and "--tokenizer" in bad.output and "Traceback" not in bad.output


# -- the stage -----------------------------------------------------------------------------------------------

TINY_WORLD = [
    "prepare.world.sft_train=24", "prepare.world.sft_eval=8", "prepare.world.prefs_train=24",
    "prepare.world.prefs_eval=8", "prepare.world.prompts_train=16", "prepare.world.prompts_eval=8",
    "prepare.tokenizer_vocab_size=512",
]


def test_stage_passes_the_demo_data_and_fails_on_a_leaked_prompt(workspace):
    from tasks.runner import run_stage

    shutil.copy(REPO / "params.yaml", workspace / "params.yaml")
    run_stage("prepare", workspace, overrides=TINY_WORLD)
    counts = run_stage("validate", workspace, overrides=TINY_WORLD)
    assert counts["success"] and counts["failed"] == 0 and counts["checks"] > 50
    assert counts["rows"] == sum(v["rows"] for k, v in counts.items() if isinstance(v, dict))
    report = json.loads((workspace / "reports" / "validation" / "report.json").read_text())
    assert report["token_budget"]["tokenizer"] == "models/tokenizer", "paths relative to the workspace"
    assert {d["name"] for d in report["datasets"]} == {"sft_train", "sft_eval", "prefs_train", "prefs_eval",
                                                       "prompts_train", "prompts_eval"}

    # an eval prompt that is also a training prompt: the stage writes its report, then fails the CLI
    leaked = json.loads((workspace / "data" / "sft_train.jsonl").read_text().splitlines()[0])["prompt"]
    path = workspace / "data" / "prompts_eval.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["prompt"] = leaked
    write_jsonl(path, rows)
    with pytest.raises(ValidationFailed, match="prompts_eval: no `prompt` also appears in a train split"):
        run_stage("validate", workspace, overrides=TINY_WORLD)
    result = CliRunner().invoke(app, ["stage", "validate", *[x for o in TINY_WORLD for x in ("--set", o)]])
    assert result.exit_code == 1 and "data validation failed" in result.output and "Traceback" not in result.output
    summary = (workspace / "reports" / "validation" / "summary.md").read_text()
    assert "## prompts_eval" in summary and "row 2" in summary and "sft_train" in summary
    assert json.loads((workspace / "metrics" / "validate.json").read_text())["prompts_eval"]["failed"] == 1


def test_dvc_repro_stops_before_training_on_data_that_failed(tmp_path):
    """Real data whose preference pair has chosen == rejected: `dvc repro` runs prepare and validate, fails,
    and never trains the reward model."""
    for item in ("dvc.yaml", ".gitignore"):
        shutil.copy(REPO / item, tmp_path / item)
    for package in ("rlhf_core", "tasks"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    posts = [f"post {i} about w{i}" for i in range(20)]
    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "completion": f"summary {i}"} for i, p in enumerate(posts)])
    pairs = [{"prompt": p, "chosen": f"good {i}", "rejected": f"bad {i}"} for i, p in enumerate(posts)]
    pairs[3]["rejected"] = pairs[3]["chosen"]
    write_jsonl(tmp_path / "prefs.jsonl", pairs)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["prepare"] = {"source": "files", "sft": "sft.jsonl", "preferences": "prefs.jsonl",
                         "eval_fraction": 0.5, "tokenizer_vocab_size": 300, "max_prompt_tokens": 64,
                         "max_completion_tokens": 16}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "DVC_NO_ANALYTICS": "1", "RLHF_TRACKING": "off", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True)
    proc = subprocess.run(["dvc", "repro", "reward-model"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "Running stage 'validate'" in output and "`chosen` differs from `rejected`" in output
    assert "Running stage 'reward-model'" not in output and not (tmp_path / "models" / "reward").exists()
    report = json.loads((tmp_path / "reports" / "validation" / "report.json").read_text())
    failed = [(d["name"], c["rows"]) for d in report["datasets"] for c in d["checks"] if not c["success"]]
    assert len(failed) == 1 and failed[0][0] in ("prefs_train", "prefs_eval"), failed


def test_check_file_reads_budgets_from_params_yaml(workspace):
    (workspace / "params.yaml").write_text("prepare:\n  max_prompt_tokens: 1\n")
    report = check_file(write_jsonl(workspace / "p.jsonl", GOOD["prompts"]), "prompts", tokenizer="tok")
    assert report["token_budget"]["max_prompt_tokens"] == 1 and not report["success"]
