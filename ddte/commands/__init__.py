"""The command shells of `ddte`: argument parsing, one-line errors and printing around the libraries."""
