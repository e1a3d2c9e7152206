"""The sessions layer: names, states, calls into the core, history, residency, watchers."""
