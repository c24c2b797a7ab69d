"""A tokenizer for the demo world, trained locally with `tokenizers`.

Byte-level BPE, like GPT-2 and the Pythia / GPT-NeoX models it feeds: every string round-trips exactly
(``decode(encode(x)) == x``, leading space of a completion included), no text ever maps to [UNK], and
splitting at the prompt / completion boundary gives the same tokens as encoding the joined text. On the
world's few hundred words the merges run out before 2048, so nearly every word is one token.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "[PAD]", "[EOS]", "[UNK]"  # ids 0, 1, 2: the trainer assigns special tokens first
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")  # the chat template's turn headers, one token each
# Each message is its role's header and its content; an assistant turn ends with EOS (the pipeline's stop token)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOL_ROLE = "<|tool|>"  # the header of a tool message (a tokenizer trained with tools has it as a fourth role)
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")  # around each call's JSON: one token each, kept in decoded text
TOOLS_PREAMBLE = 'You may call these tools, each as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>:'
# CHAT_TEMPLATE plus tools (Hermes / Qwen style): their JSON schemas in a system turn, each assistant tool call as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> before the turn's EOS, a tool message under <|tool|>.
# Without tools or tool messages it renders what CHAT_TEMPLATE does. Prefix-preserving: a turn renders the same
# whatever follows it, so tool results append as tokens (rlhf_core/tool_chat.py).
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{{ '\\n\\n' }}{% endif %}" + TOOLS_PREAMBLE +
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{%- elif messages and messages[0]['role'] == 'system' %}<|system|>{{ messages[0]['content'] }}{% endif %}"
    "{%- for message in messages %}{%- if not (loop.first and message['role'] == 'system') %}"
    "{%- if message['role'] == 'assistant' %}<|assistant|>{{ message['content'] or '' }}"
    "{%- for call in message.tool_calls or [] %}{%- set fn = call.function if call.function is defined else call %}"
    "<tool_call>{\"name\": {{ fn.name | tojson }}, \"arguments\": "
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}</tool_call>{%- endfor %}{{ eos_token }}"
    "{%- else %}<|{{ message['role'] }}|>{{ message['content'] }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
# How `tokenizer.parse_response` reads an assistant turn of TOOL_CHAT_TEMPLATE: each <tool_call> JSON one call,
# the text up to EOS the content (the format of transformers' response templates, as TRL's for Qwen 3)
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": re.escape(EOS) + r"\s*", "content": "text"},
    },
}


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048, model_max_length: int = 512,
                    chat: bool = False, tools: bool = False) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts`.

    It adds no special tokens when encoding (callers append EOS) and pads on the right (callers that
    generate set `padding_side = "left"`). 512 tokens hold a world prompt and completion several times over.
    With `chat`, it also has the role headers as special tokens and `CHAT_TEMPLATE`. With `tools` (implies `chat`),
    the tool role too, <tool_call> and </tool_call> as tokens that decoding keeps, `TOOL_CHAT_TEMPLATE` and
    `RESPONSE_TEMPLATE`: what multi-turn rollouts with tools need (rlhf_core/tool_chat.py).
    """
    chat = chat or tools
    specials = [PAD, EOS, UNK] + (list(ROLE_TOKENS) if chat else []) + ([TOOL_ROLE] if tools else [])
    assert vocab_size > 256 + len(specials), \
        f"vocab_size must exceed the 256 bytes + {len(specials)} special tokens, got {vocab_size}"
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # keep decode exact: no " ," -> "," rewriting
        chat_template=(TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE) if chat else None,
    )
    if tools:  # not special: a reward function reading decoded text still sees where the model called a tool
        out.add_tokens(list(TOOL_CALL_TOKENS))
        out.response_template = RESPONSE_TEMPLATE
    return out
