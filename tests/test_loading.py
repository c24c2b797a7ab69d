"""Real hub-loading code, exercised on local copies (no network): models, tokenizers, datasets."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from datasets import Dataset, DatasetDict

from rlhf_core.hub import load_tokenizer, save_tokenizer
from rlhf_core.models import load_policy, load_scorer_model
from rlhf_core.sources import SourceError, _confine, check_dataset_folder, load_rows

ROWS = [{"prompt": "SUBREDDIT: r/pets\n\nPOST: my cat\n\nTL;DR:", "completion": " cat"},
        {"prompt": "SUBREDDIT: r/work\n\nPOST: my boss\n\nTL;DR:", "completion": " boss"}]


@pytest.fixture
def saved_models(tmp_path, make_policy, make_scorer_model, tokenizer):
    policy_dir, reward_dir = tmp_path / "sft", tmp_path / "reward"
    make_policy().save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    make_scorer_model().save_pretrained(reward_dir)
    return policy_dir, reward_dir


def test_models_load_from_local_copies(saved_models, make_policy, make_scorer_model):
    policy_dir, reward_dir = saved_models
    policy = load_policy(policy_dir)
    for name, value in make_policy().state_dict().items():
        torch.testing.assert_close(policy.state_dict()[name], value, msg=name)
    reward = load_scorer_model(reward_dir)
    assert reward.config.num_labels == 1 and reward.score.weight.shape == (1, 32)
    tokenizer = load_tokenizer(policy_dir)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)


def test_a_saved_tokenizer_does_not_record_how_it_was_loaded(tmp_path, tokenizer):
    """transformers writes from_pretrained's options (local_files_only, which HF_HUB_OFFLINE sets; is_local) back
    into tokenizer_config.json: the same training wrote other bytes, and another dvc.lock, in and outside `make`.
    Each load here runs in its own process, as a stage does, with the hub offline (as `make` sets it) or not."""
    import os
    import subprocess
    import sys

    save_tokenizer(tokenizer, tmp_path / "source")
    script = ("import sys; from transformers import AutoTokenizer; from rlhf_core.hub import save_tokenizer; "
              "t = AutoTokenizer.from_pretrained(sys.argv[1]); t.save_pretrained(sys.argv[2] + '-plain'); "
              "save_tokenizer(t, sys.argv[2])")
    saved = {}
    for offline in ("1", "0"):
        env = {**os.environ, "HF_HUB_OFFLINE": offline, "TRANSFORMERS_OFFLINE": offline}
        subprocess.run([sys.executable, "-c", script, str(tmp_path / "source"), str(tmp_path / offline)], env=env,
                       check=True, cwd=Path(__file__).resolve().parent.parent)
        saved[offline] = {f.name: f.read_bytes() for f in (tmp_path / offline).iterdir()}
    plain = [(tmp_path / f"{o}-plain" / "tokenizer_config.json").read_text() for o in ("1", "0")]
    assert plain[0] != plain[1], "what save_pretrained alone writes differs"
    assert saved["1"] == saved["0"], "the same bytes however the tokenizer was loaded"
    config = json.loads(saved["1"]["tokenizer_config.json"])
    assert not {"local_files_only", "is_local"} & set(config) and config["pad_token"] == tokenizer.pad_token
    assert load_tokenizer(tmp_path / "1").get_vocab() == tokenizer.get_vocab()


def test_pickle_weights_are_refused(tmp_path, make_policy):
    model = make_policy()
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # pickle weights only
    with pytest.raises(OSError, match="could not load"):
        load_policy(tmp_path)


@pytest.mark.timeout(120)  # a hang fails the test; a busy machine's slowness does not
def test_unreachable_hub_id_fails_clearly_and_never_hangs(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr"):
        load_policy("cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr")
    with pytest.raises(SourceError, match="trl-lib/tldr.*HF_HUB_OFFLINE"):
        load_rows("trl-lib/tldr", split="train")


def test_rows_from_jsonl_json_parquet_and_saved_datasets(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    DatasetDict({"train": Dataset.from_list(ROWS), "validation": Dataset.from_list(ROWS[:1])}).save_to_disk(
        str(tmp_path / "saved_dict"))
    hub_layout = tmp_path / "hub_snapshot" / "data"  # how a hub dataset repo lays out its files
    hub_layout.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS), hub_layout / "train-00000-of-00001.parquet")

    for source in ("rows.jsonl", "rows.json", "rows.parquet", "saved", "saved_dict", "hub_snapshot"):
        assert load_rows(tmp_path / source) == ROWS, source
    assert load_rows(tmp_path / "saved_dict", split="validation") == ROWS[:1]
    with pytest.raises(SourceError, match="no split 'test'"):
        load_rows(tmp_path / "saved_dict", split="test")


def _card(folder: Path, data_files: list[dict]) -> Path:
    """A dataset folder whose README.md card lists `data_files` (the hub's layout: `datasets` honours it)."""
    folder.mkdir(parents=True, exist_ok=True)
    configs = [{"config_name": "default", "data_files": data_files}]
    (folder / "README.md").write_text(f"---\n{yaml.safe_dump({'configs': configs})}---\n")
    return folder


def test_a_dataset_folder_reads_only_files_inside_it(tmp_path):
    """The card's data_files, which `datasets` honours, may not lead out of the folder (absolute, `..`, a glob, a
    symlink, a URL), nor may a saved dataset's state.json or dataset_dict.json: refused before any row is read."""
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "rows.jsonl").write_text(json.dumps({"prompt": "the secret"}) + "\n")
    Dataset.from_list([{"prompt": "the secret"}]).save_to_disk(str(secret / "saved"))
    arrow = next((secret / "saved").glob("*.arrow"))
    own = [{"split": "train", "path": "data/rows.jsonl"}]
    good = _card(tmp_path / "good", own)
    (good / "data").mkdir()
    (good / "data" / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    assert load_rows(good) == ROWS

    outside = {"absolute": _card(tmp_path / "absolute", [{"split": "train", "path": str(secret / "rows.jsonl")}]),
               "dotdot": _card(tmp_path / "dotdot", [{"split": "train", "path": "../secret/*.jsonl"}]),
               "url": _card(tmp_path / "url", [{"split": "train", "path": "https://example.invalid/rows.jsonl"}]),
               "link": _card(tmp_path / "link", own)}
    (outside["link"] / "data").mkdir()
    (outside["link"] / "data" / "rows.jsonl").symlink_to(secret / "rows.jsonl")
    saved = tmp_path / "saved"
    Dataset.from_list(ROWS).save_to_disk(str(saved))
    state = json.loads((saved / "state.json").read_text())
    state["_data_files"] = [{"filename": str(arrow)}]
    (saved / "state.json").write_text(json.dumps(state))
    outside["state"] = saved
    split_out = tmp_path / "split_out"
    DatasetDict({"train": Dataset.from_list(ROWS)}).save_to_disk(str(split_out))
    (split_out / "dataset_dict.json").write_text(json.dumps({"splits": ["../secret/saved"]}))
    outside["splits"] = split_out
    for how, folder in outside.items():
        with pytest.raises(SourceError, match="outside the dataset") as err:
            load_rows(folder)
        assert str(folder) in str(err.value) and "a dataset may name files inside it only" in str(err.value), how
        with pytest.raises(SourceError, match="outside the dataset"):
            check_dataset_folder(folder)


def test_a_hub_dataset_reads_only_its_own_repository():
    """The files a hub card names, as `datasets` resolves them, stay in that repository (no network here: the check
    on the resolved names, the part a local folder's loading does not cover)."""
    repo = ["hf://datasets/owner/tldr@", "/nonexistent-hub-cache/datasets--owner--tldr"]
    _confine("owner/tldr", ["hf://datasets/owner/tldr@0a1b/data/train-00000.parquet"], repo)
    for file in ("hf://datasets/owner/tldr-evil@0a1b/x.parquet", "hf://datasets/other/repo@0a1b/x.parquet",
                 "hf://datasets/owner/tldr@0a1b/../../other/repo/x.parquet", "/etc/passwd",
                 "https://example.invalid/x.parquet", "s3://bucket/x.parquet"):
        with pytest.raises(SourceError, match="owner/tldr: its dataset card or saved state names"):
            _confine("owner/tldr", [file], repo)


@pytest.mark.parametrize("content,message", [
    (b"", "empty"),
    (b'{"prompt": "a"}\n{"prompt": \n', "line 2 is not valid JSON"),
    (b'["not", "an object"]\n', "line 1 is list, expected a JSON object"),
    (b"\xff\xfe\x00garbage", "not UTF-8"),
])
def test_unreadable_files_name_the_problem(tmp_path, content, message):
    path = tmp_path / "broken.jsonl"
    path.write_bytes(content)
    with pytest.raises(SourceError, match=message) as err:
        load_rows(path)
    assert "broken.jsonl" in str(err.value)


def test_missing_and_unsupported_sources(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="unsupported file type '.csv'"):
        load_rows(tmp_path / "rows.csv")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(SourceError, match="not a readable Parquet"):
        load_rows(tmp_path / "bad.parquet")


@pytest.fixture
def train_workspace(workspace, make_policy, make_scorer_model, tokenizer):
    """models/sft and models/reward as the train stage reads them (nothing else: the checks come first)."""
    for name, model in (("sft", make_policy()), ("reward", make_scorer_model())):
        model.save_pretrained(workspace / "models" / name)
        tokenizer.save_pretrained(workspace / "models" / name)
    return workspace


def test_bad_model_inputs_are_named_before_anything_loads(train_workspace, make_policy, tiny_config, tokenizer):
    from transformers import GPTNeoXForSequenceClassification

    from rlhf_core.bench import word_tokenizer
    from tasks.checks.model_checks import ModelInputError, check_reward_model, check_tokenizers

    sft, reward = train_workspace / "models" / "sft", train_workspace / "models" / "reward"
    check_reward_model(reward)
    check_tokenizers(sft, reward)
    make_policy().save_pretrained(train_workspace / "causal")
    with pytest.raises(ModelInputError, match="causal: the reward model is a GPTNeoXForCausalLM, not a sequence"):
        check_reward_model(train_workspace / "causal")
    two_labels = copy.deepcopy(tiny_config)  # the fixture is the session's: other tests read it unchanged
    two_labels.num_labels = 2
    GPTNeoXForSequenceClassification(two_labels).save_pretrained(train_workspace / "two")
    with pytest.raises(ModelInputError, match="num_labels=2"):
        check_reward_model(train_workspace / "two")
    word_tokenizer(20).save_pretrained(train_workspace / "other")
    with pytest.raises(ModelInputError, match=r"differ in 4 tokens \(e.g. \['w16'"):
        check_tokenizers(sft, train_workspace / "other")
    no_pad = word_tokenizer(16)
    no_pad.pad_token = None
    no_pad.save_pretrained(train_workspace / "nopad")
    with pytest.raises(ModelInputError, match="nopad: the tokenizer has no pad token"):
        check_tokenizers(train_workspace / "nopad", reward)


def test_train_refuses_a_causal_lm_as_reward_model(train_workspace, make_policy):
    from typer.testing import CliRunner

    from cli.main import app

    make_policy().save_pretrained(train_workspace / "models" / "reward")  # over the reward model
    result = CliRunner().invoke(app, ["stage", "train"])
    assert result.exit_code == 1 and "the reward model is a GPTNeoXForCausalLM" in result.output, result.output
    assert "Traceback" not in result.output and not (train_workspace / "checkpoints").exists()
