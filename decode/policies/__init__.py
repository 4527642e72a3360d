"""Who picks each step's tree, at run time: the policy interface and the static and heuristic rules (``base``), the
policy kinds (``kinds``) and their spec grammar (``spec``), the one builder from a spec (``build``), root features
(``features``), per-node signals and the halting rule (``signals``, ``halting``), the selector and the expander
(``selector``, ``expander``) and the draft budget a batch shares (``budget``). Policy files and their fitting live in
``files/`` and ``fit/``; the step-time model every policy prices with in decode/cost/."""
