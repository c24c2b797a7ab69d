"""A tokenizer for the demo world, trained locally with `tokenizers`.

Byte-level BPE, like GPT-2 and the Pythia / GPT-NeoX models it feeds: every string round-trips exactly
(``decode(encode(x)) == x``, leading space of a completion included), no text ever maps to [UNK], and
splitting at the prompt / completion boundary gives the same tokens as encoding the joined text. On the
world's few hundred words the merges run out before 2048, so nearly every word is one token.
"""

from __future__ import annotations

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


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048, model_max_length: int = 512,
                    chat: bool = False) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts`.

    It adds no special tokens when encoding (callers append EOS) and pads on the right (callers that
    generate set `padding_side = "left"`). 512 tokens hold a world prompt and completion several times over.
    With `chat`, it also has the role headers as special tokens and `CHAT_TEMPLATE`.
    """
    specials = [PAD, EOS, UNK] + (list(ROLE_TOKENS) if chat else [])
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
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # keep decode exact: no " ," -> "," rewriting
        chat_template=CHAT_TEMPLATE if chat else None,
    )
