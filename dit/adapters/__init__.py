"""Adapters that run SAKURA on diffusers transformers (see ``dit/adapters/README.md``)."""
