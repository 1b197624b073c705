"""Model families: everything that knows tensor names and math."""

from .backend import apply_backend_defaults

apply_backend_defaults()  # before any evaluation: the backend reads them when it first runs
