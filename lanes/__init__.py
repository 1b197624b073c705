"""The lane core: streams, rounds, pricing, guards, verification."""
