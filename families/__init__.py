"""Model families: everything that knows tensor names and math."""
