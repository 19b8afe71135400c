"""The engine layer: everything that turns requests into steps on the devices and steps
back into tokens, with no knowledge of any front end (docs/architecture.md)."""
