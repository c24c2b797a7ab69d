"""The datasets as the stages read them: the layouts `prepare` accepts and rows rendered as text."""
