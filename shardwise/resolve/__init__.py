"""Resolving a run once: the config's checks and adaptations, the layout, and the ``ResolvedRun``
the trainer and the planner share."""
