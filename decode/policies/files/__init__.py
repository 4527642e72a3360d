"""What a policy file holds, apart from the policies that run it: the metadata scheme every exported ONNX file
shares (``policy_file``), the selector's and the expander's file contracts (``selector_file``, ``expander_file``),
the deployment file (``deployment``, ``policy.json``), what a file measured at some sampling settings
(``sampling_table``) and the machine-free profiles that let the running machine re-pick a file's static fallback
(``guard``). Reading a file's metadata needs no inference session."""
