"""Figures and reports: the stages' PNG plots, DVC's offline plots, and the sweep's KL-reward frontier with
its uncertainty."""
