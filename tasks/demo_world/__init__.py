"""The built-in demo world's wiring: its tiny models and its gold reward."""
