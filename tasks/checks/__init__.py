"""Checks before work: Great Expectations suites for the data, and the models a stage is given."""
