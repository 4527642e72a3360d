"""Who picks each step's tree: the policy interface and the static and heuristic rules (``base``), root features
(``features``), the step-time model (``latency``), the never-lose guard's machine half (``guard``), the selector
and the expander with their file contracts (``selector``, ``selector_file``, ``expander``, ``expander_file``) and
the deployment file that chooses among them (``deployment``)."""
