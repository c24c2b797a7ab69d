"""The demo world: synthetic TL;DR data with a known gold reward.

- vocabulary.py: the closed vocabularies posts are drawn from (and facts are parsed back out of);
- generator.py: posts, reference and perturbed summaries, and the datasets (`build_world`);
- gold.py: the gold reward of a summary (`gold_reward`, `gold_breakdown`);
- config.py: the world's sizes and noise (`WorldConfig`);
- tokenizer.py: a byte-level BPE tokenizer trained on the world's text.
"""
