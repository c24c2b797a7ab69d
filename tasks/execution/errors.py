"""The base classes of the errors a stage raises to say what is wrong and how to fix it.

The CLI prints such an error's message without a traceback. It lives apart from the stages so that catching it
imports nothing heavy: `rlhf stage validate` must not load torch's model code to handle a failed check.
"""


class StageFailed(Exception):
    """A stage failure whose message says it all (bad data, a failed inspection, a tracking server that does not
    answer, a refused registration, a bad model input, a non-finite loss)."""


class VerdictFailed(StageFailed):
    """A check stage that did all its work and judged the inputs bad (data validation, reward-model inspection):
    its reports are whole and say why, so they stay in the workspace for the user to read, where the put-back
    (tasks/execution/put_back.py) would remove or replace the outputs of a stage that did not finish."""
