"""Using what a campaign trained: the routed ensemble as a language model over bytes (docs/inference.md)."""
