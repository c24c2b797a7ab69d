"""Conversational data (TRL's message format): rendering, prepare's conversions, validation, the whole pipeline."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from rlhf_core import chat
from rlhf_core.config import SFTConfig
from rlhf_core.sft_trainer import IGNORE_INDEX, encode_sft
from rlhf_core.world.config import WorldConfig
from rlhf_core.world.generator import SYSTEM_PROMPT, build_world
from rlhf_core.world.gold import gold_reward
from rlhf_core.world.tokenizer import train_tokenizer
from tasks.stages.prepare import normalize
from tests.test_pipeline import TINY, run_all_stages

# The word tokenizer's words (one token each) joined by spaces; the generation prompt is the space before the answer.
WORD_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' and persona is defined %}{{ persona }} "
                 "{% endif %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
                 "{% if add_generation_prompt %} {% endif %}")


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def world_tokenizer():
    world = build_world(0, WorldConfig(sft_train=64, prefs_train=64, conversational=True))
    texts = [m["content"] for split in ("sft_train", "prefs_train") for row in world[split] for v in row.values()
             for m in v]
    return train_tokenizer(texts, vocab_size=1024, chat=True), world


def test_the_world_variant_is_the_same_world_in_messages(world_tokenizer):
    _, world = world_tokenizer
    plain = build_world(0, WorldConfig(sft_train=64, prefs_train=64))
    row, plain_row = world["prefs_train"][0], plain["prefs_train"][0]
    assert row["prompt"] == [{"role": "system", "content": SYSTEM_PROMPT}, user(plain_row["prompt"])]
    assert row["chosen"] == [assistant(plain_row["chosen"])] and row["rejected"] == [assistant(plain_row["rejected"])]
    assert world["prompts_eval"][0]["reference"] == [assistant(plain["prompts_eval"][0]["reference"])]


def test_a_templated_prompt_ends_at_the_assistant_turn_and_the_answer_is_its_content(world_tokenizer):
    tokenizer, world = world_tokenizer
    row = world["sft_train"][0]
    rendered = chat.render_row(row, tokenizer)
    assert rendered["prompt"].startswith("<|system|>" + SYSTEM_PROMPT + "<|user|>")
    assert rendered["prompt"].endswith("TL;DR:<|assistant|>")
    assert rendered["completion"] == row["completion"][0]["content"]  # the template's closing EOS is cut
    ids = tokenizer(rendered["prompt"], add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|assistant|>") == ids[-1], "each role header is one token"
    # the world's gold reward reads the post from the templated prompt as from the plain one
    plain = row["prompt"][1]["content"]
    assert gold_reward(rendered["prompt"], rendered["completion"]) == gold_reward(plain, rendered["completion"])


def test_sft_loss_is_on_the_assistant_turn_only(world_tokenizer):
    tokenizer, world = world_tokenizer
    row = chat.render_row(world["sft_train"][0], tokenizer)
    (input_ids, labels), = encode_sft(tokenizer, [row], SFTConfig())
    learned = [token for token, label in zip(input_ids, labels, strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(learned) == world["sft_train"][0]["completion"][0]["content"] + tokenizer.eos_token
    ignored = tokenizer.decode([t for t, label in zip(input_ids, labels, strict=True) if label == IGNORE_INDEX])
    assert ignored == row["prompt"] and SYSTEM_PROMPT in ignored


def test_chat_template_kwargs_reach_the_template(tokenizer):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = WORD_TEMPLATE
    prompt = [{"role": "system", "content": "w2"}, user("w3")]
    assert chat.render_prompt(tokenizer, prompt) == "w2 w3 "
    assert chat.render_prompt(tokenizer, prompt, {"persona": "w9"}) == "w9 w2 w3 "
    assert chat.render_answer(tokenizer, prompt, [assistant("w4")], {"persona": "w9"}) == "w4"


def test_text_passes_through_and_messages_without_a_template_are_refused(tokenizer):
    assert chat.render_row({"prompt": "w2", "completion": " w3"}, tokenizer) == {"prompt": "w2", "completion": " w3"}
    assert not tokenizer.chat_template
    with pytest.raises(chat.ChatTemplateError, match="no chat template; set prepare.chat_template"):
        chat.render_rows([{"prompt": [user("w2")]}], tokenizer)


def test_prepare_converts_trl_layouts_to_an_explicit_prompt():
    sft = normalize([{"messages": [{"role": "system", "content": "s"}, user("q"), assistant("a")]}], "sft")
    assert sft == [{"prompt": [{"role": "system", "content": "s"}, user("q")], "completion": [assistant("a")]}]
    implicit = {"chosen": [user("q"), assistant("a"), user("q2"), assistant("good")],
                "rejected": [user("q"), assistant("a"), user("q2"), assistant("bad")]}
    assert normalize([implicit], "prefs") == [{"prompt": [user("q"), assistant("a"), user("q2")],
                                              "chosen": [assistant("good")], "rejected": [assistant("bad")]}]
    # the same first answer is not taken into the prompt: the answers start after the last user turn
    same_start = {"chosen": [user("q"), assistant("yes, and more")], "rejected": [user("q"), assistant("yes")]}
    assert normalize([same_start], "prefs")[0]["prompt"] == [user("q")]


# -- validation ----------------------------------------------------------------------------------------------------

CONVERSATIONAL = {
    "prompts": [{"prompt": [{"role": "system", "content": "w2"}, user("w3")]},
                {"prompt": [user("w4"), assistant("w5"), user("w6")], "reference": [assistant("w7")]}],
    "sft": [{"prompt": [user("w2")], "completion": [assistant("w3")]},
            {"prompt": [user("w2")], "completion": [assistant("w4 w5")]}],
    "preferences": [{"prompt": [user("w2")], "chosen": [assistant("w4")], "rejected": [assistant("w5")]},
                    {"prompt": [user("w3")], "chosen": [assistant("w6")], "rejected": [assistant("w5 w5")]}],
}


def conversational_edit(kind: str, row: int, **changes) -> list[dict]:
    rows = [dict(r) for r in CONVERSATIONAL[kind]]
    return rows + [{**rows[row - 1], **changes}]


BROKEN_CONVERSATIONS = {  # name: (kind, rows, the failed check's description, its rows)
    "prompt ends with the assistant": ("sft", conversational_edit("sft", 1, prompt=[user("w2"), assistant("w3")]),
                                       "`prompt` as messages: an optional system message", [3]),
    "unknown role": ("prompts", conversational_edit("prompts", 1, prompt=[{"role": "bot", "content": "w2"}]),
                     "`prompt` as messages", [3]),
    "blank message": ("preferences", conversational_edit("preferences", 1, chosen=[assistant("  ")]),
                      "every message of `chosen` has non-blank text content", [3]),
    "answer restates the conversation": ("preferences",
                                         conversational_edit("preferences", 2, rejected=[user("w3"), assistant("w5")]),
                                         "`rejected` as messages: assistant messages only", [3]),
    "text answer to a conversation": ("sft", conversational_edit("sft", 1, completion="w3"),
                                      "`completion` answer the row's own `prompt` in its format", [3]),
    "message without content": ("sft", conversational_edit("sft", 2, completion=[{"role": "assistant"}]),
                                "`completion` is a string or a list of {role, content} messages", [3]),
}


@pytest.fixture
def templated_workspace(tmp_path, monkeypatch, tokenizer):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLHF_TRACKING", "off")
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = WORD_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "tok")
    return tmp_path


def validate(path: Path, kind: str):
    return CliRunner().invoke(app, ["validate", str(path), "--kind", kind, "--tokenizer", "tok",
                                    "--max-prompt-tokens", "4", "--max-completion-tokens", "3", "--json"])


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("kind", CONVERSATIONAL)
def test_good_conversations_pass(templated_workspace, kind):
    result = validate(write_jsonl(templated_workspace / f"{kind}.jsonl", CONVERSATIONAL[kind]), kind)
    assert result.exit_code == 0, result.output
    checks = {c["description"] for c in json.loads(result.output)["datasets"][0]["checks"]}
    assert any(d.startswith("`prompt` as messages") for d in checks)
    assert "conversations render with the tokenizer's chat template" in checks


@pytest.mark.parametrize("name", BROKEN_CONVERSATIONS)
def test_broken_conversations_fail_naming_the_rows(templated_workspace, name):
    kind, rows, description, bad_rows = BROKEN_CONVERSATIONS[name]
    result = validate(write_jsonl(templated_workspace / "data.jsonl", rows), kind)
    assert result.exit_code == 1, result.output
    failed = [c for c in json.loads(result.output)["datasets"][0]["checks"] if not c["success"]]
    matching = [c for c in failed if c["description"].startswith(description)]
    assert matching, [c["description"] for c in failed]
    assert matching[0]["rows"] == bad_rows


def test_prompt_token_budget_counts_the_templated_text(templated_workspace):
    # five words of content: within the raw user text's 3, over the budget of 4 once the system message renders
    rows = [{"prompt": [{"role": "system", "content": "w2 w3"}, user("w4 w5 w6")]}]
    result = validate(write_jsonl(templated_workspace / "p.jsonl", rows), "prompts")
    failed = [c for c in json.loads(result.output)["datasets"][0]["checks"] if not c["success"]]
    assert [c["description"] for c in failed] == ["`prompt` has at most 4 tokens (policy tokenizer)"]


# -- the whole pipeline --------------------------------------------------------------------------------------------

def test_the_pipeline_runs_on_the_conversational_world(workspace):
    run_all_stages(*[x for item in TINY + ["prepare.world.conversational=true"] for x in ("--set", item)])
    row = json.loads((workspace / "data" / "prefs_train.jsonl").open().readline())
    assert chat.is_conversation(row["prompt"]) and chat.roles(row["chosen"]) == "assistant"
    saved = json.loads((workspace / "models" / "tokenizer" / "tokenizer_config.json").read_text())
    template = (workspace / "models" / "tokenizer" / "chat_template.jinja")
    assert template.is_file() or saved.get("chat_template"), "the tokenizer carries the chat template"
    report = json.loads((workspace / "reports" / "validation" / "report.json").read_text())
    checks = [c for d in report["datasets"] for c in d["checks"]]
    assert report["success"] and any(c["column"] == "prompt_roles" for c in checks)
    completions = [json.loads(line) for line in (workspace / "reports" / "eval" / "completions.jsonl").open()]
    assert all(chat.is_conversation(r["prompt"]) for r in completions), "the table shows the messages"
    assert all(isinstance(r["completion"], str) for r in completions)
    evaluation = json.loads((workspace / "metrics" / "eval.json").read_text())
    assert {"win_rate_gold", "win_rate_rm", "mean_kl"} <= set(evaluation)
