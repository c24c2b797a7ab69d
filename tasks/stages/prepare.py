"""Stage `prepare`: the canonical datasets and the tokenizer.

Reads the built-in world or real sources (local JSONL / Parquet, saved datasets, hub ids), normalizes
rows of every layout it reads (tasks/data/layouts.py) to the canonical schema, drops exact duplicates and
over-long rows (counting both), and writes `data/<split>.jsonl` plus `models/tokenizer/`.

Conversational rows (TRL's format) stay messages in `data/`; their token lengths are those of the text the
chat template renders (rlhf_core/chat.py), which the tokenizer saved here carries to every later stage.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from rlhf_core import chat
from rlhf_core.hub import load_tokenizer, save_tokenizer
from rlhf_core.jsonio import atomic_path, write_json, write_jsonl
from rlhf_core.sources import load_rows
from rlhf_core.world.generator import build_world
from rlhf_core.world.tokenizer import TOOLS_PREAMBLE, train_tokenizer
from tasks.data.layouts import TOOLS, normalize
from tasks.parameters.params import Params, PrepareParams
from tasks.parameters.paths import SPLITS, Paths


def dedupe(rows: Sequence[dict]) -> list[dict]:
    seen, out = set(), []
    for row in rows:
        key = tuple(sorted((k, chat.key(v)) for k, v in row.items()))
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def length_filter(rows: Sequence[dict], tokenizer, cfg: PrepareParams) -> list[dict]:
    """Drop rows whose prompt or completion texts (as the chat template renders them) exceed the token budgets."""
    limits = {"prompt": cfg.max_prompt_tokens}
    limits.update({k: cfg.max_completion_tokens for k in chat.ANSWER_COLUMNS})
    cells = [(i, limits[k], text) for i, row in enumerate(rows)
             for k, text in chat.render_row(row, tokenizer, cfg.chat_template_kwargs).items()
             if k in limits and isinstance(text, str)]
    lengths = map(len, tokenizer([text for *_, text in cells], add_special_tokens=False)["input_ids"] if cells else [])
    too_long = {i for (i, limit, _), length in zip(cells, lengths, strict=True) if length > limit}
    return [row for i, row in enumerate(rows) if i not in too_long]


def world_splits(params: Params) -> dict[str, list[dict]]:
    world = build_world(params.base.seed, params.prepare.world)
    return {name: world[name] for name in SPLITS}


def source_splits(cfg: PrepareParams, seed: int) -> dict[str, list[dict]]:
    """Real data: SFT and preference sources, prompts from SFT rows; eval held out by prompt."""
    if not (cfg.sft and cfg.preferences):
        raise ValueError("prepare.sft and prepare.preferences are required when prepare.source is not 'world'")
    sft = normalize(load_rows(cfg.sft), "sft")
    prefs = normalize(load_rows(cfg.preferences), "prefs")
    prompts = normalize(load_rows(cfg.prompts), "prompts") if cfg.prompts else \
        [{"prompt": r["prompt"], "reference": r["completion"], **({TOOLS: r[TOOLS]} if TOOLS in r else {})}
         for r in sft]
    rng = random.Random(seed)
    unique_prompts = dict.fromkeys(chat.key(r["prompt"]) for r in prompts)  # first-seen order: seeded draws
    held_out = {p for p in unique_prompts if rng.random() < cfg.eval_fraction}
    split = lambda rows: ([r for r in rows if chat.key(r["prompt"]) not in held_out],  # noqa: E731
                          [r for r in rows if chat.key(r["prompt"]) in held_out])
    (sft_train, sft_eval), (prefs_train, prefs_eval), (prompts_train, prompts_eval) = map(split, (sft, prefs, prompts))
    return {"sft_train": sft_train, "sft_eval": sft_eval, "prefs_train": prefs_train, "prefs_eval": prefs_eval,
            "prompts_train": [{k: r[k] for k in ("prompt", TOOLS) if k in r} for r in prompts_train],
            "prompts_eval": prompts_eval}


def tools_text(row: dict) -> list[str]:
    """A row's tools as the world's tool chat template shows them to the model (the preamble, a schema a line)."""
    tools = chat.row_tools(row)
    return [TOOLS_PREAMBLE + "".join("\n" + json.dumps(tool) for tool in tools)] if isinstance(tools, list) else []


def make_tokenizer(cfg: PrepareParams, splits: dict[str, list[dict]]):
    """The pipeline's tokenizer: `prepare.tokenizer`, or one trained on the training texts (with the world's chat
    template when the world is conversational, its tool chat template for the tool task); `prepare.chat_template`
    replaces its template."""
    if cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer)
    else:
        tools = cfg.source == "world" and cfg.world.tool_task
        texts = [text for name in ("sft_train", "prefs_train") for row in splits[name] for value in row.values()
                 for text in ([chat.message_text(m) for m in value] if chat.is_conversation(value) else [value])
                 if isinstance(text, str)]  # a row's `tools` schemas are no training text...
        if tools:  # ...but for the tool task, as every prompt shows them: they become a few tokens
            texts += [text for name in ("sft_train", "prefs_train") for row in splits[name] for text in tools_text(row)]
        tokenizer = train_tokenizer(texts, vocab_size=cfg.tokenizer_vocab_size,
                                    chat=cfg.source == "world" and cfg.world.conversational, tools=tools)
    if cfg.chat_template:
        path = Path(cfg.chat_template)
        if not path.is_file():
            raise ValueError(f"prepare.chat_template: {path}: no such file; expected a Jinja chat template")
        tokenizer.chat_template = path.read_text(encoding="utf-8")
    return tokenizer


def run(params: Params, paths: Paths) -> dict:
    cfg = params.prepare
    splits = world_splits(params) if cfg.source == "world" else source_splits(cfg, params.base.seed)
    tokenizer = make_tokenizer(cfg, splits)
    report = {}
    for name in SPLITS:
        rows = splits[name]
        unique = dedupe(rows)
        kept = length_filter(unique, tokenizer, cfg)
        report[name] = {"rows_in": len(rows), "duplicates": len(rows) - len(unique),
                        "too_long": len(unique) - len(kept), "rows": len(kept)}
        if not kept:
            raise ValueError(f"prepare: split {name} is empty after filtering ({report[name]})")
        write_jsonl(paths.split(name), kept)
    with atomic_path(paths.tokenizer, directory=True) as tmp:
        save_tokenizer(tokenizer, tmp)
    write_json(paths.metrics_file("prepare"), report)
    return report
