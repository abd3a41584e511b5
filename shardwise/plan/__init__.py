"""Plan before launch: per-rank memory, communication and step time of a layout (``estimate``),
and the best layouts of a model on a cluster (``plan``), without the cluster."""
