"""The expander fit: per-node halting rules and the learned head fitted on a collection's episodes
(``expansion_fit.py``), scored offline and cross-fitted (``expansion.py``), and the expander file written
(``expander.py``, ``ddte expander``)."""
