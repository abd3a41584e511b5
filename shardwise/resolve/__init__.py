"""Resolving a run once: the config's checks and adaptations, the layout, the ``ResolvedRun`` the
trainer and the planner share, and preflight (the files' checks, the tokenizer and the data plan)."""
