"""The ``conceptdict`` command line: thin glue over the three stages."""
