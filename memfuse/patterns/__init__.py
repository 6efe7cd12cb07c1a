"""Patterns: plug-ins (the loss head, attention masks) that register what the core needs to know."""
