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
from tests.test_pipeline import TINY, invoke, run_all_stages
from tests.test_validate import write_jsonl

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



@pytest.mark.parametrize("kind", CONVERSATIONAL)
def test_good_conversations_pass(templated_workspace, kind):
    result = validate(write_jsonl(templated_workspace / f"{kind}.jsonl", CONVERSATIONAL[kind]), kind)
    assert result.exit_code == 0, result.output
    checks = {c["description"] for c in json.loads(result.output)["datasets"][0]["checks"]}
    assert any(d.startswith("`prompt` as messages") for d in checks)
    assert "conversations render with the tokenizer's chat template" in checks


@pytest.mark.parametrize("kind", CONVERSATIONAL)
def test_a_tokenizer_without_a_chat_template_is_one_error_naming_it(tmp_path, monkeypatch, tokenizer, kind):
    """Valid conversations checked with a tokenizer that has no chat template failed every row with
    ChatTemplateError (exit 1, as if the data were bad) at 2a5c0fd: now one error naming the tokenizer and the
    ways out (exit 2); plain-text data still validates with it."""
    monkeypatch.chdir(tmp_path)
    tokenizer.save_pretrained(tmp_path / "tok")  # a word tokenizer with no chat template
    result = validate(write_jsonl(tmp_path / f"{kind}.jsonl", CONVERSATIONAL[kind]), kind)
    assert result.exit_code == 2, result.output
    assert "has no chat template" in result.output and "'tok'" in result.output, result.output
    assert "--skip-token-lengths" in result.output and "prepare.chat_template" in result.output, result.output
    assert "ChatTemplateError" not in result.output and "row" not in result.output, result.output
    plain = validate(write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "w2 w3"}]), "prompts")
    assert plain.exit_code == 0, plain.output


def failed_checks_naming(workspace, kind: str, rows: list[dict], description: str, bad_rows: list[int]) -> list:
    """`rlhf validate` of `rows` fails, with a failed check starting with `description` that names `bad_rows`;
    returns every failed check."""
    result = validate(write_jsonl(workspace / "data.jsonl", rows), kind)
    assert result.exit_code == 1, result.output
    failed = [c for c in json.loads(result.output)["datasets"][0]["checks"] if not c["success"]]
    matching = [c for c in failed if c["description"].startswith(description)]
    assert matching, [c["description"] for c in failed]
    assert matching[0]["rows"] == bad_rows
    return failed


@pytest.mark.parametrize("name", BROKEN_CONVERSATIONS)
def test_broken_conversations_fail_naming_the_rows(templated_workspace, name):
    failed_checks_naming(templated_workspace, *BROKEN_CONVERSATIONS[name])


def test_prompt_token_budget_counts_the_templated_text(templated_workspace):
    # five words of content: within the raw user text's 3, over the budget of 4 once the system message renders
    rows = [{"prompt": [{"role": "system", "content": "w2 w3"}, user("w4 w5 w6")]}]
    result = validate(write_jsonl(templated_workspace / "p.jsonl", rows), "prompts")
    failed = [c for c in json.loads(result.output)["datasets"][0]["checks"] if not c["success"]]
    assert [c["description"] for c in failed] == ["`prompt` has at most 4 tokens (policy tokenizer)"]


# -- the whole pipeline --------------------------------------------------------------------------------------------

@pytest.mark.slow
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
    # GRPO on the same templated prompts and models: its train and evaluate stages (8 completions per prompt)
    grpo = [x for item in TINY + ["prepare.world.conversational=true", "train.algo=grpo"] for x in ("--set", item)]
    for name in ("train", "evaluate"):
        invoke("stage", name, *grpo)
    trained = json.loads((workspace / "metrics" / "train.json").read_text())
    assert "kl" in trained and "clip_ratio/region_mean" in trained, "GRPO's loss logged its own figures (TRL's kl)"
    completions = [json.loads(line) for line in (workspace / "reports" / "eval" / "completions.jsonl").open()]
    assert completions and all(chat.is_conversation(r["prompt"]) for r in completions)


# -- every layout `prepare` reads validates as it is (tasks/data/layouts.py) ----------------------------------------

SYSTEM = {"role": "system", "content": "w9"}
LAYOUTS = {  # name: (kind, rows as the file holds them, the layout the report names)
    "sft text": ("sft", [{"prompt": "w2 w3", "completion": "w4"}, {"prompt": "w5", "completion": "w6 w7"}],
                 "explicit prompt"),
    "sft conversational prompt-completion": ("sft", CONVERSATIONAL["sft"], "explicit prompt"),
    "sft TRL messages": ("sft", [{"messages": [SYSTEM, user("w3"), assistant("w4")]},
                                 {"messages": [user("w3 w5"), assistant("w4"), user("w6"), assistant("w7 w8")]}],
                         "messages"),
    "sft post/summary": ("sft", [{"post": "w2 w3", "summary": "w4"}, {"post": "w5", "summary": "w6 w7"}],
                         "explicit prompt"),
    "sft query/response": ("sft", [{"query": "w2 w3", "response": "w4"}], "explicit prompt"),
    "preferences text": ("preferences", [{"prompt": "w2", "chosen": "w4", "rejected": "w5"}], "explicit prompt"),
    "preferences conversational": ("preferences", CONVERSATIONAL["preferences"], "explicit prompt"),
    "preferences TRL implicit prompt": ("preferences", [
        {"chosen": [user("w2"), assistant("w4")], "rejected": [user("w2"), assistant("w5")]},
        {"chosen": [SYSTEM, user("w3"), assistant("w6")], "rejected": [SYSTEM, user("w3"), assistant("w5 w5")]},
        {"chosen": [user("w2"), assistant("w3"), user("w4"), assistant("w6")],
         "rejected": [user("w2"), assistant("w3"), user("w4"), assistant("w7")]}], "implicit prompt"),
    "preferences query": ("preferences", [{"query": "w2 w3", "chosen": "w4", "rejected": "w5 w6"}],
                          "explicit prompt"),
    "prompts text": ("prompts", [{"prompt": "w2 w3"}, {"prompt": "w4", "reference": "w5"}], "explicit prompt"),
    "prompts conversational": ("prompts", CONVERSATIONAL["prompts"], "explicit prompt"),
    "prompts query/reference_response": ("prompts", [{"query": "w2 w3", "reference_response": "w4"}, {"query": "w5"}],
                                         "explicit prompt"),
    "prompts post": ("prompts", [{"post": "w2 w3", "reference": "w4"}], "explicit prompt"),
}
PREPARE_KIND = {"sft": "sft", "preferences": "prefs", "prompts": "prompts"}


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_prepare_reads_validates_as_it_is(templated_workspace, name):
    kind, rows, layout = LAYOUTS[name]
    result = validate(write_jsonl(templated_workspace / "data.jsonl", rows), kind)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)["datasets"][0]
    assert report["layout"] == layout
    checks = {c["description"] for c in report["checks"]}
    assert any("at most 4 tokens" in d for d in checks) and any("at most 3 tokens" in d for d in checks), checks
    # prepare reads the same file into rows of our schema, and those pass the stage's suite too
    prepared = normalize(rows, PREPARE_KIND[kind])
    assert all(set(row) >= set(layout_fields(kind)) for row in prepared)
    again = validate(write_jsonl(templated_workspace / "prepared.jsonl", prepared), kind)
    assert again.exit_code == 0, again.output


def layout_fields(kind: str) -> tuple[str, ...]:
    from tasks.data.layouts import SCHEMA

    return SCHEMA[PREPARE_KIND[kind]]


def test_trl_layouts_prepare_does_not_read_fail_naming_what_is_missing(templated_workspace):
    # TRL's language-modeling `text` and its implicit prompt as plain text are not read by prepare
    text_lm = validate(write_jsonl(templated_workspace / "lm.jsonl", [{"text": "w2 w3"}]), "sft")
    failed = [c["description"] for c in json.loads(text_lm.output)["datasets"][0]["checks"] if not c["success"]]
    assert text_lm.exit_code == 1 and any(d.startswith("column `prompt` exists (or `query`, `post`; or TRL's `messages`")
                                          for d in failed), failed
    implicit_text = validate(write_jsonl(templated_workspace / "p.jsonl", [{"chosen": "w2 w4", "rejected": "w2 w5"}]),
                             "preferences")
    failed = [c for c in json.loads(implicit_text.output)["datasets"][0]["checks"] if not c["success"]]
    assert implicit_text.exit_code == 1
    assert [c["description"].split(" (")[0] for c in failed] == [
        "`chosen` is a list of {role, content} messages", "`rejected` is a list of {role, content} messages"]


def with_row(name: str, row: dict) -> list[dict]:
    """The good rows of layout `name` plus `row` (row 3 or later)."""
    return [*LAYOUTS[name][1], row]


BROKEN_LAYOUTS = {  # name: (kind, rows, the failed check's description, its rows)
    "messages end with the user": ("sft", with_row("sft TRL messages", {"messages": [user("w2"), assistant("w3"),
                                                                                     user("w4")]}),
                                   "`messages`: an optional system message", [3]),
    "messages with an unknown role": ("sft", with_row("sft TRL messages", {"messages": [user("w2"),
                                                                                        {"role": "bot", "content": "w3"}]}),
                                      "`messages`: an optional system message", [3]),
    "a blank message": ("sft", with_row("sft TRL messages", {"messages": [user("w2"), assistant(" ")]}),
                        "every message of `messages` has non-blank text content", [3]),
    "messages as text": ("sft", with_row("sft TRL messages", {"messages": "w2 w3"}),
                         "`messages` is a list of {role, content} messages", [3]),
    "no messages": ("sft", with_row("sft TRL messages", {"other": "w2"}), "`messages` is present", [3]),
    "messages prompt over budget": ("sft", with_row("sft TRL messages", {"messages": [user("w2 w3 w4 w5 w6"),
                                                                                      assistant("w7")]}),
                                    "the prompt of `messages` (all before its closing assistant messages) has at "
                                    "most 4 tokens", [3]),
    "messages completion over budget": ("sft", with_row("sft TRL messages", {"messages": [user("w2"),
                                                                                          assistant("w3 w4 w5 w6")]}),
                                        "the completion of `messages` (its closing assistant messages) has at most 3",
                                        [3]),
    "duplicate messages": ("sft", with_row("sft TRL messages", LAYOUTS["sft TRL messages"][1][0]),
                           "no duplicate `messages` rows", [1, 3]),
    "no shared prompt": ("preferences", with_row("preferences TRL implicit prompt", {
        "chosen": [user("w2"), assistant("w4")], "rejected": [user("w3"), assistant("w5")]}),
        "`chosen` and `rejected` open with the same prompt", [4]),
    "an answer restating the conversation": ("preferences", with_row("preferences TRL implicit prompt", {
        "chosen": [user("w2"), assistant("w4"), user("w6"), assistant("w7")], "rejected": [user("w2"), assistant("w5")]}),
        "`chosen` after the shared prompt: assistant messages only", [4]),
    "chosen equals rejected": ("preferences", with_row("preferences TRL implicit prompt", {
        "chosen": [user("w6"), assistant("w4")], "rejected": [user("w6"), assistant("w4")]}),
        "`chosen` differs from `rejected`", [4]),
    "a blank rejected message": ("preferences", with_row("preferences TRL implicit prompt", {
        "chosen": [user("w2"), assistant("w4")], "rejected": [user("w2"), assistant("")]}),
        "every message of `rejected` has non-blank text content", [4]),
    "an implicit answer over budget": ("preferences", with_row("preferences TRL implicit prompt", {
        "chosen": [user("w2"), assistant("w4")], "rejected": [user("w2"), assistant("w5 w6 w7 w8")]}),
        "`rejected` after the shared prompt has at most 3 tokens", [4]),
    "a shared prompt over budget": ("preferences", with_row("preferences TRL implicit prompt", {
        "chosen": [user("w2 w3 w4 w5 w6"), assistant("w4")], "rejected": [user("w2 w3 w4 w5 w6"), assistant("w5")]}),
        "the prompt `chosen` and `rejected` share has at most 4 tokens", [4]),
    "duplicate pairs": ("preferences", with_row("preferences TRL implicit prompt",
                                                LAYOUTS["preferences TRL implicit prompt"][1][0]),
                        "no duplicate (`chosen`, `rejected`) rows", [1, 4]),
    "a blank summary": ("sft", with_row("sft post/summary", {"post": "w2", "summary": " "}), "`summary` is not blank",
                        [3]),
    "a query over budget": ("prompts", with_row("prompts query/reference_response", {"query": "w2 w3 w4 w5 w6"}),
                            "`query` has at most 4 tokens", [3]),
    "a reference_response over budget": ("prompts", with_row("prompts query/reference_response", {
        "query": "w8", "reference_response": "w2 w3 w4 w5"}), "`reference_response` has at most 3 tokens", [3]),
}


@pytest.mark.parametrize("name", BROKEN_LAYOUTS)
def test_a_broken_layout_fails_naming_its_own_column_and_rows(templated_workspace, name):
    failed = failed_checks_naming(templated_workspace, *BROKEN_LAYOUTS[name])
    assert len(failed) == 1, f"one problem, one failed check: {[c['description'] for c in failed]}"


# -- tool calling (#54): TRL's `tools` column, assistant tool_calls, tool messages ----------------------------------

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"key": {"type": "string", "description": "the word"}}, "required": ["key"]}}}


def tool_call(name, arguments):
    return {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": name,
                                                                                  "arguments": arguments}}]}


def tool(content, name="lookup"):
    return {"role": "tool", "name": name, "content": content}


EXCHANGE = [user("w2"), tool_call("lookup", {"key": "w2"}), tool("w5")]
TOOL_ROWS = {  # each layout prepare reads, as TRL's tool-calling datasets hold it (`tools` as JSON text or a list)
    "sft": [{"messages": [*EXCHANGE, assistant("w5")], "tools": json.dumps([LOOKUP])},
            {"messages": [user("w3"), tool_call("lookup", '{"key": "w3"}')], "tools": json.dumps([LOOKUP])}],
    "sft explicit": [{"prompt": [user("w2")], "completion": [tool_call("lookup", {"key": "w2"})], "tools": [LOOKUP]},
                     {"prompt": EXCHANGE, "completion": [assistant("w5")], "tools": [LOOKUP]}],
    "prompts": [{"prompt": [user("w2")], "tools": [LOOKUP]}, {"prompt": [user("w3")], "tools": [LOOKUP]}],
    "preferences": [{"prompt": EXCHANGE, "chosen": [assistant("w5")], "rejected": [assistant("w6")],
                     "tools": [LOOKUP]}],
}


@pytest.fixture(scope="module")
def tool_tokenizer_dir(tmp_path_factory):
    """The world's tokenizer trained with tools (its chat template renders tools, calls and tool messages)."""
    texts = ["w2 w3 w4 w5 w6 lookup key", json.dumps(LOOKUP)]
    folder = tmp_path_factory.mktemp("tool_tok")
    train_tokenizer(texts, vocab_size=400, tools=True).save_pretrained(folder)
    return folder


def validate_tools(path: Path, kind: str, tokenizer: Path):
    return CliRunner().invoke(app, ["validate", str(path), "--kind", kind, "--tokenizer", str(tokenizer),
                                    "--max-prompt-tokens", "512", "--max-completion-tokens", "64", "--json"])


@pytest.mark.parametrize("name", TOOL_ROWS)
def test_tool_call_datasets_pass_in_every_layout(templated_workspace, tool_tokenizer_dir, name):
    kind = name.split()[0]
    result = validate_tools(write_jsonl(templated_workspace / "tools.jsonl", TOOL_ROWS[name]), kind,
                            tool_tokenizer_dir)
    assert result.exit_code == 0, result.output
    checks = {c["description"] for c in json.loads(result.output)["datasets"][0]["checks"]}
    assert any(d.startswith("`tools` is a list of function schemas") for d in checks)
    assert any(d.startswith("every tool call of") for d in checks) and \
        "conversations render with the tokenizer's chat template" in checks


BROKEN_TOOL_ROWS = {  # name: (kind, rows, the failed check's description, its rows)
    "call of a function the row lacks": ("sft", TOOL_ROWS["sft"] + [
        {"messages": [user("w2"), tool_call("search", {"key": "w2"})], "tools": [LOOKUP]}],
        "every tool call of `messages`", [3]),
    "arguments that are no object": ("sft", TOOL_ROWS["sft"] + [
        {"messages": [user("w2"), tool_call("lookup", "[1, 2")], "tools": [LOOKUP]}],
        "every tool call of `messages`", [3]),
    "tool result without a call": ("sft", TOOL_ROWS["sft"] + [
        {"messages": [user("w2"), tool("w5"), assistant("w5")], "tools": [LOOKUP]}],
        "`messages`: an optional system message", [3]),
    "tools that are no schemas": ("prompts", TOOL_ROWS["prompts"] + [{"prompt": [user("w4")], "tools": [{"x": 1}]}],
                                  "`tools` is a list of function schemas", [3]),
}


@pytest.mark.parametrize("name", BROKEN_TOOL_ROWS)
def test_broken_tool_calls_fail_naming_the_rows(templated_workspace, tool_tokenizer_dir, name):
    kind, rows, description, bad_rows = BROKEN_TOOL_ROWS[name]
    result = validate_tools(write_jsonl(templated_workspace / "tools.jsonl", rows), kind, tool_tokenizer_dir)
    assert result.exit_code == 1, result.output
    failed = [c for c in json.loads(result.output)["datasets"][0]["checks"] if not c["success"]]
    matching = [c for c in failed if c["description"].startswith(description)]
    assert matching and matching[0]["rows"] == bad_rows, [(c["description"], c["rows"]) for c in failed]


def test_a_chat_template_without_tools_is_one_error_naming_the_file_and_row(templated_workspace):
    """WORD_TEMPLATE renders messages but drops tool calls: one error naming the file, the first row that uses tools,
    its column and what is expected (exit 2), not a failed check on every row."""
    rows = [{"prompt": [user("w2")], "completion": [assistant("w3")]}, *TOOL_ROWS["sft explicit"]]
    path = write_jsonl(templated_workspace / "tools.jsonl", rows)
    result = validate_tools(path, "sft", templated_workspace / "tok")
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"{path}: row 2 uses tools (`completion`)" in text, text
    assert "drops part of a tool exchange" in text and "Expected a chat template that renders a row's `tools`" in text
    assert "Traceback" not in result.output


def test_prepare_keeps_the_tools_column_and_renders_with_it(tool_tokenizer_dir):
    from rlhf_core.hub import load_tokenizer
    from tasks.data.layouts import normalize

    rows = normalize(TOOL_ROWS["sft"], "sft")
    assert [row["tools"] for row in rows] == [json.dumps([LOOKUP])] * 2
    assert rows[0]["prompt"] == EXCHANGE and rows[0]["completion"] == [assistant("w5")]
    rendered = chat.render_row(rows[1], load_tokenizer(tool_tokenizer_dir))
    assert '"name": "lookup"' in rendered["prompt"], "the row's tools are rendered into the prompt"
    assert rendered["completion"] == '<tool_call>{"name": "lookup", "arguments": {"key": "w3"}}</tool_call>'
