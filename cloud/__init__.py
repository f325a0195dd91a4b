"""SAKURA cloud side: publishing template packs, storage backends and the HTTP server.

See ``cloud/README.md`` for the API, the Range decisions, auth, storage and scale-out.
"""
