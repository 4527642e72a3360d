"""The model card of ``ddte pair-card``: ``card`` measures any pair (one settings class, one ``measure``), ``folder``
adds the optional section of a ``ddte train-pair`` folder (the shipped pair in models/), ``markdown`` writes the
tables."""
