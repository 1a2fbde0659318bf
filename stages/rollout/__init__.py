"""Rollout generators: data sources, inference engines (torch, SGLang) and the streaming generator loop."""
