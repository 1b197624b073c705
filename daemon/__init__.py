"""The daemon: HTTP, schemas, metrics, the command line."""
