"""The acceptance model: β̂ at a node from the draft's state there (``acceptance.py``), its dense data
(``acceptance_data.py``), its training and export (``acceptance_train.py``) and its file contract
(``acceptance_file.py``)."""
