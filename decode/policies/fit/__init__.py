"""Fitting a halting rule on episodes (``rule_fit``: the grid and the search, shared by the offline fit and the
decoder) and refitting an expander's rule on the running machine's latency table (``machine_fit``). numpy only."""
